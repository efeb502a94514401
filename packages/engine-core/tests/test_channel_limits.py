"""EngineCore on TCP (``--engine-address``): what a peer without the secret can make it hold.

The secret is checked on a call's metadata, before any of its message is read: oversized
unauthenticated calls, unary and streaming, are refused with ``UNAUTHENTICATED`` and
EngineCore's memory grows by a bounded amount (HTTP/2 flow-control windows), not by what
they sent. The front end that launched it still sends messages far above gRPC's default
4 MiB cap.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import psutil
import pytest
import pytest_asyncio

from engine.core.config import EngineConfig
from engine.core.rpc import GrpcCoreClient
from engine.core.startup import prepare
from engine.sdk.sampling_params import SamplingParams
from engine.sdk.scheduler import EngineRequest

MIB = 2**20
#: Per call; four of them would take EngineCore's memory up by ~480 MiB if read.
ATTACK_BYTES = 120 * MIB
#: How much EngineCore's resident memory may grow under the four calls.
GROWTH_BOUND = 64 * MIB
METHODS = ("CollectiveRpc", "GetStats", "Health", "Stream")  # unary ones and the stream


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tcp_client(tiny_llama: Path) -> AsyncIterator[GrpcCoreClient]:
    setup = prepare(EngineConfig(model=str(tiny_llama), dtype="float32", num_kv_blocks=64,
                                 plugins="none"))
    client = GrpcCoreClient(setup.config, setup.manifest, eos_token_id=None,
                            engine_address="127.0.0.1:0")
    await client.start()
    yield client
    await client.shutdown()


pytestmark = pytest.mark.asyncio(loop_scope="module")


class PeakRss(threading.Thread):
    """Samples a process's resident memory until stopped; ``peak`` is the largest seen."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.process = psutil.Process(pid)
        self.peak = self.process.memory_info().rss
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(0.01):
            self.peak = max(self.peak, self.process.memory_info().rss)


def unauthenticated_call(address: str, method: str, payload: bytes) -> grpc.StatusCode:
    options = [("grpc.max_send_message_length", 2 * ATTACK_BYTES)]
    with grpc.insecure_channel(address, options=options) as channel:
        call = channel.unary_unary(f"/engine.v1.EngineCore/{method}")
        try:
            call(payload, timeout=60)
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[no-any-return]
    raise AssertionError(f"{method} without the secret was answered")


async def test_unauthenticated_oversized_calls_are_refused_unread(
        tcp_client: GrpcCoreClient) -> None:
    assert tcp_client.address is not None and tcp_client.pid is not None
    payload = b"\n" + bytes(ATTACK_BYTES)  # a length-delimited field, then zeros
    sampler = PeakRss(tcp_client.pid)
    before = sampler.peak
    sampler.start()
    codes: dict[str, grpc.StatusCode] = {}
    threads = [threading.Thread(target=lambda m=m: codes.__setitem__(
        m, unauthenticated_call(tcp_client.address or "", m, payload))) for m in METHODS]
    for thread in threads:
        thread.start()
    await asyncio.to_thread(lambda: [thread.join(90) for thread in threads])
    sampler.stopped.set()
    sampler.join()
    assert codes == dict.fromkeys(METHODS, grpc.StatusCode.UNAUTHENTICATED)
    growth = sampler.peak - before
    assert growth < GROWTH_BOUND, (
        f"EngineCore grew by {growth / MIB:.0f} MiB under {len(METHODS)} unauthenticated "
        f"{ATTACK_BYTES // MIB} MiB calls (bound {GROWTH_BOUND // MIB} MiB)")
    assert await tcp_client.is_healthy()


async def test_the_front_end_still_sends_large_messages(tcp_client: GrpcCoreClient) -> None:
    # ~6 MiB of stop strings: one message above gRPC's default 4 MiB cap.
    stop = [f"never-{i:07d}-" + "x" * 500 for i in range(12_000)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, stop=stop)
    tcp_client.add_requests([EngineRequest("large", tuple(range(3, 200)), params)])
    tokens: list[int] = []
    async for step in tcp_client.outputs():
        for output in step.outputs:
            assert output.request_id == "large"
            tokens += output.new_token_ids
        if any(output.finished for output in step.outputs):
            break
    assert len(tokens) == 4
