"""EngineCore in its own process through GrpcCoreClient: same tokens, clean ends, private channel.

Each test spawns one EngineCore process on the tiny checkpoint (a few seconds each).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from engine.core.config import EngineConfig
from engine.core.engine.engine_core import EngineCore
from engine.core.frontend.front_end import eos_token_id_of
from engine.core.messages import EngineDeadError
from engine.core.plugins import ManifestEntry, PluginManifest
from engine.core.rpc import SECRET_METADATA_KEY, GrpcCoreClient
from engine.core.rpc._gen import engine_core_pb2 as pb
from engine.core.rpc._gen import engine_core_pb2_grpc as pb_grpc
from engine.core.startup import EngineSetup, prepare
from engine.core.tokenizer import load_tokenizer
from engine.sdk.sampling_params import SamplingParams
from engine.sdk.scheduler import EngineCoreOutput, EngineRequest, RequestStatus

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LOGPROBS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def requests() -> list[EngineRequest]:
    prompts = [list(range(3, 3 + n)) for n in (5, 23, 9, 41)]
    reqs = [EngineRequest(f"greedy-{i}", tuple(p), GREEDY) for i, p in enumerate(prompts)]
    reqs.append(EngineRequest("logprobs", tuple(range(10, 30)), LOGPROBS))
    reqs.append(EngineRequest("aborted", tuple(range(50, 70)), LONG))
    reqs.append(EngineRequest("finished", tuple(range(80, 95)), LONG))
    return reqs


@pytest.fixture(scope="module")
def setup(tiny_llama: Path) -> EngineSetup:
    return prepare(EngineConfig(model=str(tiny_llama), dtype="float32", num_kv_blocks=128))


@pytest.fixture(scope="module")
def eos(setup: EngineSetup) -> int | None:
    return eos_token_id_of(load_tokenizer(setup.source), setup.hf_config)


@pytest.fixture(scope="module")
def direct(setup: EngineSetup, eos: int | None) -> dict[str, list[EngineCoreOutput]]:
    """Every request run to completion on EngineCore in this process."""
    core = EngineCore(setup, eos_token_id=eos)
    for request in requests():
        core.add_request(request)
    outputs: dict[str, list[EngineCoreOutput]] = {}
    while core.has_unfinished_requests():
        for output in core.step():
            outputs.setdefault(output.request_id, []).append(output)
    core.shutdown()
    return outputs


def tokens(outputs: list[EngineCoreOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def assert_gone(pid: int, socket_dir: str | None) -> None:
    with pytest.raises(ProcessLookupError):  # a zombie would still accept signal 0
        os.kill(pid, 0)
    assert pid not in [p.pid for p in multiprocessing.active_children()]
    assert socket_dir is None or not os.path.exists(socket_dir)


async def test_same_tokens_as_engine_core_directly(setup: EngineSetup, eos: int | None,
                                                   direct) -> None:
    client = GrpcCoreClient(setup.config, setup.manifest, eos_token_id=eos)
    info = await client.start()
    assert (info.num_kv_blocks, info.block_size, info.vocab_size) == (128, 16, 512)
    socket_dir, pid = client.socket_dir, client.pid
    assert socket_dir is not None and pid is not None
    assert stat.S_IMODE(os.stat(socket_dir).st_mode) == 0o700
    assert await client.is_healthy()

    client.add_requests(requests())
    got: dict[str, list[EngineCoreOutput]] = {}
    open_ids = {r.request_id for r in requests()}
    async for step in client.outputs():
        assert step.scheduler_stats is not None and step.timestamp > 0
        for output in step.outputs:
            got.setdefault(output.request_id, []).append(output)
            if output.finished:
                open_ids.discard(output.request_id)
        if len(tokens(got.get("aborted", []))) >= 3 and "aborted" in open_ids:
            client.abort_requests(["aborted"])
            open_ids.discard("aborted")
        if len(tokens(got.get("finished", []))) >= 2 and "finished" in open_ids:
            client.finish_requests(["finished"], RequestStatus.FINISHED_STOPPED)
            open_ids.discard("finished")
        if not open_ids:
            break

    for request_id in [f"greedy-{i}" for i in range(4)] + ["logprobs"]:
        assert got[request_id] == direct[request_id], request_id
    for request_id in ("aborted", "finished"):  # ended early: a prefix of the full run
        partial = tokens(got[request_id])
        assert 2 <= len(partial) < 40
        assert partial == tokens(direct[request_id])[:len(partial)]

    stats = await client.get_stats()
    for _ in range(50):  # the abort and the finish travel on the stream: let them land
        if stats.num_running_reqs == stats.num_waiting_reqs == 0:
            break
        await asyncio.sleep(0.02)
        stats = await client.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks == 128
    assert await client.reset_prefix_cache()

    await client.shutdown()
    assert_gone(pid, socket_dir)
    assert not await client.is_healthy()
    with pytest.raises(EngineDeadError, match="shut down"):
        client.add_requests(requests()[:1])
    # Ends, does not raise; it may first hand over steps that arrived before the abort and
    # the finish landed (the faster the steps, the more), for those two requests only.
    leftover = [step async for step in client.outputs()]
    assert {o.request_id for step in leftover for o in step.outputs} <= {"aborted", "finished"}
    await client.shutdown()  # idempotent


async def test_sigkill_is_noticed_within_a_second(setup: EngineSetup, eos: int | None) -> None:
    client = GrpcCoreClient(setup.config, setup.manifest, eos_token_id=eos)
    await client.start()
    pid, socket_dir = client.pid, client.socket_dir
    assert pid is not None
    client.add_requests([EngineRequest("long", tuple(range(3, 40)),
                                       SamplingParams(temperature=0, max_tokens=200,
                                                      ignore_eos=True))])
    outputs = client.outputs()
    await anext(outputs)  # it is running

    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()

    async def drain() -> None:
        async for _ in outputs:
            pass

    with pytest.raises(EngineDeadError) as info:
        await asyncio.wait_for(drain(), timeout=1.0)
    assert time.monotonic() - killed_at < 1.0
    assert f"EngineCore process (pid {pid}) ended: killed by SIGKILL" in str(info.value)
    assert client.dead_error is not None
    assert not await client.is_healthy()
    with pytest.raises(EngineDeadError, match="SIGKILL"):
        client.add_requests([EngineRequest("late", (3, 4), GREEDY)])
    with pytest.raises(EngineDeadError):
        await client.get_stats()
    await asyncio.wait_for(client.shutdown(), timeout=5.0)
    assert_gone(pid, socket_dir)


async def test_tcp_needs_the_secret_on_every_call(setup: EngineSetup, eos: int | None) -> None:
    client = GrpcCoreClient(setup.config, setup.manifest, eos_token_id=eos,
                            engine_address="127.0.0.1:0")
    await client.start()
    try:
        assert client.socket_dir is None and client.secret
        address = client.address
        assert address is not None and address.startswith("127.0.0.1:")
        channel = grpc.insecure_channel(address)
        stub = pb_grpc.EngineCoreStub(channel)
        for metadata in (None, ((SECRET_METADATA_KEY, "wrong"),)):
            with pytest.raises(grpc.RpcError) as info:
                stub.Health(pb.HealthRequest(), metadata=metadata, timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as info:
                next(iter(stub.Stream(iter([]), metadata=metadata, timeout=5)))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        ok = stub.Health(pb.HealthRequest(), metadata=((SECRET_METADATA_KEY, client.secret),),
                         timeout=5)
        assert ok.healthy
        channel.close()

        client.add_requests([EngineRequest("tcp", (3, 4, 5), GREEDY)])
        got = []
        async for step in client.outputs():
            got += [t for o in step.outputs for t in o.new_token_ids]
            if any(o.finished for o in step.outputs):
                break
        assert len(got) == GREEDY.max_tokens
    finally:
        await client.shutdown()


@pytest.mark.parametrize("case", ["missing-model", "plugin-mismatch"])
async def test_startup_error_surfaces_in_start(setup: EngineSetup, case: str) -> None:
    config, manifest = setup.config, setup.manifest
    if case == "missing-model":
        config = config.model_copy(update={"model": "/nonexistent/engine-model"})
        expected = "/nonexistent/engine-model"
    else:
        manifest = PluginManifest(entries=(*manifest.entries, ManifestEntry(
            group="engine.schedulers", name="ghost", value="ghost:Scheduler",
            distribution="ghost-scheduler", version="9.9")))
        expected = "EngineCore process does not have the same plugins.*ghost-scheduler"
    client = GrpcCoreClient(config, manifest, eos_token_id=None)
    with pytest.raises(EngineDeadError, match=expected):
        await client.start()
    assert client.dead_error is not None
    assert client.pid is not None
    assert_gone(client.pid, client.socket_dir)


FRONT_END = """
import asyncio, sys
from engine.core.config import EngineConfig
from engine.core.rpc import GrpcCoreClient
from engine.core.startup import prepare

async def main():
    setup = prepare(EngineConfig.model_validate_json(sys.argv[1]))
    client = GrpcCoreClient(setup.config, setup.manifest, eos_token_id=None)
    await client.start()
    print(client.pid, client.socket_dir, flush=True)
    await asyncio.sleep(600)

if __name__ == "__main__":
    asyncio.run(main())
"""


def is_running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for init, which may never reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_engine_core_exits_when_the_front_end_dies(setup: EngineSetup, tmp_path: Path) -> None:
    script = tmp_path / "front_end.py"
    script.write_text(FRONT_END)
    with subprocess.Popen([sys.executable, str(script), setup.config.model_dump_json()],
                          stdout=subprocess.PIPE, text=True) as front_end:
        try:
            assert front_end.stdout is not None
            pid_text, socket_dir = front_end.stdout.readline().split()
            pid = int(pid_text)
            assert is_running(pid)
            front_end.kill()  # SIGKILL: no chance to shut EngineCore down
            front_end.wait()
            deadline = time.monotonic() + 5.0
            while is_running(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not is_running(pid), "EngineCore outlived its front end"
            assert not os.path.exists(socket_dir)
        finally:
            front_end.kill()
