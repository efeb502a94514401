"""worker.proto: exact round trips of the step messages; a real server over a fake worker."""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from engine.core.rpc._gen import worker_pb2 as pb
from engine.core.rpc.worker_client import (
    WorkerCallError,
    WorkerClient,
    WorkerRpcError,
    WorkerUnavailableError,
    encode_scheduler_output,
)
from engine.core.rpc.worker_convert import (
    runner_output_from_proto,
    runner_output_to_proto,
    scheduler_output_from_proto,
    scheduler_output_to_proto,
    worker_error_from_proto,
    worker_error_to_proto,
)
from engine.core.rpc.worker_server import make_worker_server
from engine.sdk.errors import PluginError
from engine.sdk.sampling_params import SamplingParams
from engine.sdk.scheduler import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SampleLogprobs,
    SchedulerOutput,
)


def wire(message):
    """Serialise and parse again, as the channel does."""
    return type(message).FromString(message.SerializeToString())


def so_round_trip(out: SchedulerOutput) -> SchedulerOutput:
    return scheduler_output_from_proto(wire(scheduler_output_to_proto(out)))


def ro_round_trip(out: ModelRunnerOutput) -> ModelRunnerOutput:
    return runner_output_from_proto(wire(runner_output_to_proto(out)))


def f32(value: float) -> float:
    return float(struct.unpack("<f", struct.pack("<f", value))[0])


def assert_same_scheduler_output(back: SchedulerOutput, out: SchedulerOutput) -> None:
    assert back == out
    assert list(back.num_scheduled_tokens) == list(out.num_scheduled_tokens)  # order kept
    assert type(back.finished_req_ids) is frozenset
    assert type(back.preempted_req_ids) is frozenset
    assert type(back.kv_connector_metadata) is type(out.kv_connector_metadata)
    cached = back.scheduled_cached_reqs
    for column in (cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
        assert type(column) is tuple
    assert all(type(row) is tuple for row in cached.new_block_ids)
    for new in back.scheduled_new_reqs:
        assert type(new.prompt_token_ids) is tuple and type(new.block_ids) is tuple
        assert type(new.output_token_ids) is tuple


def new_req(req_id: str, prompt: tuple[int, ...], **kwargs: Any) -> NewRequestData:
    return NewRequestData(req_id=req_id, prompt_token_ids=prompt,
                          sampling_params=kwargs.pop("sampling_params", SamplingParams()),
                          block_ids=kwargs.pop("block_ids", (1, 2)),
                          num_computed_tokens=kwargs.pop("num_computed_tokens", 0), **kwargs)


FULL_PARAMS = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=2**40, max_tokens=64,
                             stop=("END",), stop_token_ids=(7,), logprobs=3, prompt_logprobs=0,
                             logit_bias={5: -1.5}, extra_args={"ban": [1, 2], "n": 3})
EVERYTHING = SchedulerOutput(
    scheduled_new_reqs=(
        new_req("new-0", (1, 2, 3, 2**31 - 1), sampling_params=FULL_PARAMS,
                block_ids=(4, 5), num_computed_tokens=16),
        new_req("resumed", (9, 8), block_ids=(6,), output_token_ids=(-1, 0, 42)),
    ),
    scheduled_cached_reqs=CachedRequestData(
        req_ids=("c0", "c1", "c2"), new_block_ids=((), (11, 12), ()),
        num_computed_tokens=(100, 0, 2**31 - 1)),
    num_scheduled_tokens={"c0": 1, "c1": 7, "c2": 1, "new-0": 4, "resumed": 5},
    total_num_scheduled_tokens=18,
    finished_req_ids=frozenset({"gone-1", "gone-2"}),
    preempted_req_ids=frozenset({"victim"}),
    kv_connector_metadata=b"\x00connector\xff",
)


@pytest.mark.parametrize("out", [
    EVERYTHING,
    SchedulerOutput((), CachedRequestData(), {}, 0),
    SchedulerOutput((), CachedRequestData(), {}, 0, finished_req_ids=frozenset({"x"}),
                    kv_connector_metadata=b""),
    SchedulerOutput((), CachedRequestData(("a", "b"), ((), ()), (5, 6)), {"a": 1, "b": 1}, 2),
    # The new request first, a cached request left out: the ids travel in their own column.
    SchedulerOutput((new_req("n", (1,)),), CachedRequestData(("a", "b"), ((3,), ()), (5, 6)),
                    {"n": 1, "b": 1}, 2),
    SchedulerOutput((new_req("n", ()),), CachedRequestData(), {}, 0),
], ids=["everything", "empty", "finished-only-empty-metadata", "decode", "custom-order",
        "unscheduled"])
def test_scheduler_output_round_trip(out: SchedulerOutput) -> None:
    assert_same_scheduler_output(so_round_trip(out), out)


def test_kv_connector_metadata_none_and_empty_differ() -> None:
    empty = SchedulerOutput((), CachedRequestData(), {}, 0, kv_connector_metadata=b"")
    assert so_round_trip(empty).kv_connector_metadata == b""
    assert so_round_trip(SchedulerOutput((), CachedRequestData(), {}, 0)
                         ).kv_connector_metadata is None


def test_default_order_sends_no_id_twice() -> None:
    msg = scheduler_output_to_proto(EVERYTHING)
    assert not msg.HasField("num_scheduled_req_ids")
    assert not scheduler_output_to_proto(
        SchedulerOutput((), CachedRequestData(("a",), ((),), (1,)), {"a": 1}, 1)
    ).scheduled_cached_reqs.new_block_id_counts  # decode: no row lengths at all
    custom = SchedulerOutput((new_req("n", (1,)),), CachedRequestData(("a",), ((),), (1,)),
                             {"n": 1, "a": 1}, 2)
    assert list(scheduler_output_to_proto(custom).num_scheduled_req_ids.ids) == ["n", "a"]


def test_cached_request_delta_does_not_carry_its_prompt() -> None:
    prompt = tuple(range(1000, 3000))
    first = SchedulerOutput((new_req("r", prompt, block_ids=tuple(range(1, 126))),),
                            CachedRequestData(), {"r": 2000}, 2000)
    later = SchedulerOutput((), CachedRequestData(("r",), ((126,),), (2000,)), {"r": 1}, 1)
    first_bytes, later_bytes = encode_scheduler_output(first), encode_scheduler_output(later)
    assert len(first_bytes) > 4 * len(prompt)
    assert len(later_bytes) < 40
    assert struct.pack("<4i", *prompt[:4]) not in later_bytes


LOGPROBS = SampleLogprobs(token_ids=((5, 5, 9), (), (7, 1, 2)),
                          logprobs=((f32(-0.1), f32(-0.1), f32(-2.5)), (),
                                    (0.0, float("-inf"), f32(-3.75))),
                          sampled_token_ranks=(1, 0, 2))


@pytest.mark.parametrize("out", [
    ModelRunnerOutput(
        req_ids=("a", "partial", "b"), sampled_token_ids=((5,), (), (7,)), logprobs=LOGPROBS,
        prompt_logprobs={"b": SampleLogprobs(((3, 4), (8, 1)), ((f32(-1.25), -2.0),
                                                                (f32(-0.5), -4.0)), (1, 3)),
                         "partial": SampleLogprobs((), (), ())},
        finished_sending=frozenset({"s"}), finished_recving=frozenset({"r1", "r2"})),
    ModelRunnerOutput(req_ids=("a", "b"), sampled_token_ids=((5,), (2**31 - 1,))),
    ModelRunnerOutput(req_ids=("a", "b"), sampled_token_ids=((), ())),
    ModelRunnerOutput(req_ids=("a", "b"), sampled_token_ids=((1, 2, 3), (4,))),
    ModelRunnerOutput(req_ids=(), sampled_token_ids=()),
    ModelRunnerOutput(req_ids=(), sampled_token_ids=(),
                      logprobs=SampleLogprobs((), (), ())),
], ids=["everything", "decode", "all-partial", "multi-token", "empty", "empty-logprobs"])
def test_runner_output_round_trip(out: ModelRunnerOutput) -> None:
    back = ro_round_trip(out)
    assert back == out
    assert list(back.prompt_logprobs) == list(out.prompt_logprobs)
    assert type(back.finished_sending) is frozenset and type(back.finished_recving) is frozenset
    assert type(back.sampled_token_ids) is tuple
    assert all(type(row) is tuple for row in back.sampled_token_ids)


def test_decode_output_sends_no_row_lengths() -> None:
    msg = runner_output_to_proto(ModelRunnerOutput(("a", "b"), ((5,), (6,))))
    assert msg.sampled_token_counts == b"" and len(msg.sampled_token_ids) == 8


def test_worker_error_names_rank_and_plugin() -> None:
    try:
        raise PluginError("boom", plugin="my_ext", group="engine.worker_extensions",
                          distribution="my-dist", version="1.2.0")
    except PluginError as exc:
        error = worker_error_from_proto(wire(worker_error_to_proto(exc, rank=3)))
    assert isinstance(error, WorkerCallError) and error.rank == 3
    assert (error.type, error.plugin, error.group, error.distribution, error.version) == (
        "PluginError", "my_ext", "engine.worker_extensions", "my-dist", "1.2.0")
    assert str(error).startswith("worker rank 3: PluginError: plugin 'my_ext'")
    assert str(error).endswith("(plugin my_ext of distribution my-dist 1.2.0)")
    assert "raise PluginError" in error.traceback
    plain = worker_error_from_proto(worker_error_to_proto(KeyError("k"), rank=0))
    assert str(plain) == "worker rank 0: KeyError: 'k'"
    assert (plain.plugin, plain.distribution, plain.version) == (None, None, None)


# --- a real server over a fake worker ---------------------------------------------------

@dataclass
class FakeWorker:
    """Implements WorkerProtocol; records what it was given."""

    rank: int = 1
    num_available_blocks: int = 123
    fail_with: Exception | None = None
    unhealthy: bool = False
    step_seconds: float = 0.0

    def __post_init__(self) -> None:
        self.cache_blocks: int | None = None
        self.received: list[SchedulerOutput] = []
        self._active = 0
        self.max_active = 0

    def initialize_cache(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError("negative")
        self.cache_blocks = num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._active += 1
        self.max_active = max(self.max_active, self._active)
        try:
            time.sleep(self.step_seconds)
            if self.fail_with is not None:
                raise self.fail_with
            self.received.append(scheduler_output)
            ids = tuple(scheduler_output.num_scheduled_tokens)
            return ModelRunnerOutput(req_ids=ids, sampled_token_ids=tuple((i,) for i in
                                                                         range(len(ids))))
        finally:
            self._active -= 1

    def collective_rpc(self, method: str, args: list, kwargs: dict) -> Any:
        if method == "echo":
            return {"args": args, "kwargs": kwargs}
        if method == "not_json":
            return object()
        raise AttributeError(f"no method {method!r}")

    def check_health(self) -> None:
        if self.unhealthy:
            raise RuntimeError("device lost")


@dataclass
class Served:
    worker: FakeWorker
    client: WorkerClient
    server: Any
    address: str
    shutdown_event: threading.Event


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    worker, event = FakeWorker(), threading.Event()
    executor = ThreadPoolExecutor(max_workers=4)
    server, address = make_worker_server(worker, f"unix:{tmp_path}/w.sock", executor=executor,
                                         shutdown_event=event)
    client = WorkerClient(address)
    try:
        yield Served(worker, client, server, address, event)
    finally:
        client.close()
        server.stop(0)
        executor.shutdown(wait=False)


def test_execute_model_over_a_unix_socket(served: Served) -> None:
    info = served.client.wait_ready(timeout=5)
    assert (info.rank, info.num_available_blocks) == (1, 123)
    served.client.initialize_cache(77)
    assert served.worker.cache_blocks == 77
    payload = encode_scheduler_output(EVERYTHING)
    output = served.client.execute_model_future(payload).result(timeout=5)
    assert_same_scheduler_output(served.worker.received[0], EVERYTHING)
    assert output == ModelRunnerOutput(req_ids=tuple(EVERYTHING.num_scheduled_tokens),
                                       sampled_token_ids=((0,), (1,), (2,), (3,), (4,)))


def test_calls_run_one_at_a_time(served: Served) -> None:
    served.worker.step_seconds = 0.02
    payload = encode_scheduler_output(EVERYTHING)
    futures = [served.client.execute_model_future(payload) for _ in range(4)]
    for future in futures:
        future.check(timeout=5)
    assert len(served.worker.received) == 4 and served.worker.max_active == 1


def test_worker_exception_comes_back_naming_rank_and_plugin(served: Served) -> None:
    served.worker.fail_with = PluginError("bad shapes", plugin="my_ext",
                                          group="engine.worker_extensions",
                                          distribution="my-dist", version="0.3")
    future = served.client.execute_model_future(encode_scheduler_output(EVERYTHING))
    with pytest.raises(WorkerCallError) as info:
        future.result(timeout=5)
    error = info.value
    assert (error.rank, error.type, error.plugin, error.distribution) == (
        1, "PluginError", "my_ext", "my-dist")
    assert str(error).startswith("worker rank 1: PluginError:")
    assert "(plugin my_ext of distribution my-dist 0.3)" in str(error)
    assert "bad shapes" in error.traceback
    with pytest.raises(WorkerCallError, match="ValueError: negative"):
        served.client.initialize_cache(-1)


def test_collective_rpc_json(served: Served) -> None:
    result = served.client.collective_rpc("echo", [1, 2.5, {"a": [None, True]}], {"k": "v"})
    assert result == {"args": [1, 2.5, {"a": [None, True]}], "kwargs": {"k": "v"}}
    assert type(result["args"][0]) is int
    with pytest.raises(WorkerCallError, match="worker rank 1: AttributeError: no method"):
        served.client.collective_rpc("missing")
    with pytest.raises(WorkerCallError, match="TypeError: collective_rpc 'not_json'"):
        served.client.collective_rpc("not_json")
    with pytest.raises(TypeError, match="travel as JSON"):
        served.client.collective_rpc("echo", [object()])


def test_health_and_shutdown(served: Served) -> None:
    served.client.health()
    served.worker.unhealthy = True
    with pytest.raises(WorkerCallError, match="RuntimeError: device lost"):
        served.client.health()
    assert served.client.shutdown() and served.shutdown_event.is_set()


def test_stopped_server_is_unavailable(served: Served) -> None:
    served.client.get_info()
    served.server.stop(0).wait()
    with pytest.raises(WorkerUnavailableError, match="worker rank 1 at unix:"):
        served.client.execute_model_future(encode_scheduler_output(EVERYTHING)).result(5)
    with pytest.raises(WorkerUnavailableError):
        served.client.get_info(timeout=1)
    with pytest.raises(WorkerUnavailableError, match="not ready within"):
        served.client.wait_ready(timeout=0.3)
    with pytest.raises(WorkerUnavailableError, match="exited before"):
        served.client.wait_ready(timeout=5, is_alive=lambda: False)
    assert served.client.shutdown() is False


def test_tcp_needs_the_secret() -> None:
    worker, executor = FakeWorker(rank=0), ThreadPoolExecutor(max_workers=2)
    with pytest.raises(ValueError, match="secret"):
        make_worker_server(worker, "127.0.0.1:0", executor=executor)
    server, address = make_worker_server(worker, "127.0.0.1:0", secret="s3cret",
                                         executor=executor)
    good = WorkerClient(address, secret="s3cret")
    bad, none = WorkerClient(address, secret="guess"), WorkerClient(address)
    try:
        assert good.wait_ready(timeout=5).rank == 0
        payload = encode_scheduler_output(EVERYTHING)
        assert good.execute_model_future(payload).result(5).req_ids
        for client in (bad, none):
            with pytest.raises(WorkerRpcError, match="UNAUTHENTICATED") as info:
                client.get_info(timeout=5)
            assert not isinstance(info.value, WorkerUnavailableError)
            with pytest.raises(WorkerRpcError, match="UNAUTHENTICATED"):
                client.execute_model_future(payload).result(5)
        assert len(worker.received) == 1
    finally:
        for client in (good, bad, none):
            client.close()
        server.stop(0)
        executor.shutdown(wait=False)


def test_execute_model_request_is_the_encoded_bytes() -> None:
    payload = encode_scheduler_output(EVERYTHING)
    assert pb.SchedulerOutput.FromString(payload) == scheduler_output_to_proto(EVERYTHING)
