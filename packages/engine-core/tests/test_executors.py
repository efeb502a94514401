"""Executors: ``mp`` and ``ray`` give ``uni``'s tokens, TP=2 gives TP=1's, workers die loudly.

Every engine here runs EngineCore in the test process (``in_process=True``) so the
scheduler's block pool can be checked after each scenario; the ``mp`` and ``ray`` workers
are real processes / actors.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.core import LLM, SamplingParams
from engine.core.messages import CollectiveRpcError, EngineDeadError

PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog and keeps running",
           "1 2 3 4", "Hello there, how are you today? I am fine"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)


def make_llm(path: Path, **kwargs: Any) -> LLM:
    options: dict[str, Any] = {"dtype": "float32", "plugins": "none", "num_kv_blocks": 64,
                               "in_process": True}
    options.update(kwargs)
    return LLM(str(path), **options)


def run(llm: LLM, params: SamplingParams = GREEDY) -> tuple[list[list[int]], list[Any]]:
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [o.outputs[0].logprobs for o in outputs]
    return tokens, logprobs


def assert_pool_full(llm: LLM) -> None:
    stats = llm.llm_engine.core.make_stats()
    assert stats.num_free_blocks == stats.num_total_blocks, stats


def assert_logprobs_close(a: list[Any], b: list[Any], tol: float = 1e-4) -> None:
    for rows_a, rows_b in zip(a, b, strict=True):
        for pos_a, pos_b in zip(rows_a, rows_b, strict=True):
            assert pos_a.keys() == pos_b.keys()
            for token, entry in pos_a.items():
                assert abs(entry.logprob - pos_b[token].logprob) < tol, (token, entry, pos_b)


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> tuple[list[list[int]], list[Any]]:
    """TP=1 on the uni executor."""
    with make_llm(tiny_llama) as llm:
        assert llm.llm_engine.core.executor.backend == "uni"
        return run(llm)


@pytest.fixture(scope="module")
def plugins_path(test_plugins_dir: Path) -> Iterator[Path]:
    sys.path.insert(0, str(test_plugins_dir))
    yield test_plugins_dir
    sys.path.remove(str(test_plugins_dir))


@pytest.fixture(scope="module")
def tp2(tiny_llama: Path, plugins_path: Path) -> Iterator[LLM]:
    """TP=2 over worker processes, with the test worker extension selected."""
    llm = make_llm(tiny_llama, tensor_parallel_size=2, plugins="engine-test-plugin-workers",
                   worker_extensions=["test_inspect"])
    yield llm
    llm.shutdown()


def test_mp_with_one_rank_gives_uni_tokens(tiny_llama: Path, reference: Any) -> None:
    with make_llm(tiny_llama, distributed_executor_backend="mp") as llm:
        assert llm.llm_engine.core.executor.backend == "mp"
        tokens, logprobs = run(llm)
        assert_pool_full(llm)
    assert tokens == reference[0]
    assert_logprobs_close(logprobs, reference[1])


def test_tp2_gives_tp1_tokens_and_logprobs(tp2: LLM, reference: Any) -> None:
    assert tp2.llm_engine.core.executor.backend == "mp"
    tokens, logprobs = run(tp2)
    assert tokens == reference[0]
    assert_logprobs_close(logprobs, reference[1])
    assert_pool_full(tp2)


def test_tp2_reaches_the_extension_on_every_rank(tp2: LLM, tiny_llama: Path) -> None:
    infos = tp2.collective_rpc("worker_info")
    assert [info["rank"] for info in infos] == [0, 1]
    assert all(info["world_size"] == 2 for info in infos)
    # Each rank holds half of the 2 KV heads and of the q/k/v rows: 4 heads x 16 -> 2 x 16.
    assert [info["kv_cache_shape"] for info in infos] == [infos[0]["kv_cache_shape"]] * 2
    shapes = tp2.collective_rpc("param_shape", args=("layers.0.self_attn.qkv_proj.weight",))
    assert shapes == [[64, 64], [64, 64]]  # (64 + 32 + 32) / 2 rows each, 64 columns


def test_extension_error_names_rank_and_distribution_and_workers_keep_serving(
        tp2: LLM, reference: Any) -> None:
    with pytest.raises(CollectiveRpcError) as info:
        tp2.collective_rpc("fail", args=("boom",))
    message = str(info.value)
    assert "rank 0" in message and "test_inspect" in message and "boom" in message
    assert "engine-test-plugin-workers" in message
    with pytest.raises(CollectiveRpcError, match="no worker extension defines 'nope'.*"
                                                 "worker_info"):
        tp2.collective_rpc("nope")
    calls = [info["calls"] for info in tp2.collective_rpc("worker_info")]
    assert calls[0] == calls[1] and calls[0] >= 1  # same worker objects, still serving
    assert run(tp2)[0] == reference[0]


def test_tp2_with_prefix_caching_chunked_prefill_and_preemption(tiny_llama: Path) -> None:
    shared = "The quick brown fox jumps "  # the tiny tokenizer has one token per character
    prompts = [shared + tail for tail in ("and runs", "sleeps", "quietly", "again")]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    options: dict[str, Any] = {"num_kv_blocks": 20, "block_size": 4,
                               "max_num_batched_tokens": 16, "max_model_len": 64}
    results = []
    for tp in (1, 2):
        with make_llm(tiny_llama, tensor_parallel_size=tp, **options) as llm:
            core = llm.llm_engine.core
            results.append([list(o.outputs[0].token_ids)
                            for o in llm.generate(prompts, params, use_tqdm=False)])
            stats = core.make_stats()  # counts since the engine started
            assert stats.num_preempted_reqs > 0, "the scenario must preempt"
            assert stats.prefix_cache.hits > 0, "the scenario must hit the prefix cache"
            assert stats.num_free_blocks == stats.num_total_blocks
    assert results[0] == results[1]


def test_tp2_on_qwen2(tiny_qwen2: Path) -> None:
    tokens = []
    for tp in (1, 2):
        with make_llm(tiny_qwen2, tensor_parallel_size=tp) as llm:
            tokens.append(run(llm))
    assert tokens[0][0] == tokens[1][0]
    assert_logprobs_close(tokens[0][1], tokens[1][1])


def test_clashing_extensions_are_refused(tiny_llama: Path, plugins_path: Path) -> None:
    options = {"plugins": "engine-test-plugin-workers"}
    with pytest.raises(Exception, match="'execute_model' clashes with the worker"):
        make_llm(tiny_llama, worker_extensions=["test_clash_worker"], **options)
    with pytest.raises(Exception, match="'worker_info' is also defined by worker extension "
                                        "'test_inspect'"):
        make_llm(tiny_llama, worker_extensions=["test_inspect", "test_clash_inspect"],
                 **options)


def test_killed_worker_fails_the_caller_naming_the_rank(tiny_llama: Path) -> None:
    llm = make_llm(tiny_llama, tensor_parallel_size=2)
    try:
        executor = llm.llm_engine.core.executor
        pids = [p.pid for p in executor.processes]
        engine = llm.llm_engine
        engine.add_request("r", PROMPTS[1], SamplingParams(max_tokens=150, ignore_eos=True))
        engine.step()
        os.kill(pids[1], signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"worker rank 1 \(pid \d+\) died: killed by "
                                                  r"SIGKILL"):
            while True:
                engine.step()
        assert time.monotonic() - killed < 1.0
    finally:
        llm.shutdown()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_tp_that_cannot_split_the_heads_is_refused_before_loading(tiny_llama: Path) -> None:
    with pytest.raises(Exception, match="tensor_parallel_size 3"):
        make_llm(tiny_llama, tensor_parallel_size=3)


def test_uni_with_more_ranks_is_refused(tiny_llama: Path) -> None:
    with pytest.raises(Exception, match="'uni' runs one worker"):
        make_llm(tiny_llama, tensor_parallel_size=2, distributed_executor_backend="uni")


def test_ray_tp2_gives_tp1_tokens(tiny_llama: Path, reference: Any) -> None:
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'engine-core[ray]'")
    try:
        _ray_tp2_gives_tp1_tokens(tiny_llama, reference)
    finally:
        # A start that timed out and was retried leaves Popen objects for processes Ray
        # killed but did not wait for; reap them here, not in whichever test runs next.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()


def _ray_tp2_gives_tp1_tokens(tiny_llama: Path, reference: Any) -> None:
    from engine.core.executor.ray_executor import is_ray_start_timeout

    try:
        llm = make_llm(tiny_llama, tensor_parallel_size=2, distributed_executor_backend="ray")
    except Exception as exc:
        if not is_ray_start_timeout(exc):
            raise
        pytest.skip(f"Ray's own processes did not start on this machine, twice: {exc}")
    with llm:
        assert llm.llm_engine.core.executor.backend == "ray"
        tokens, logprobs = run(llm)
        assert_pool_full(llm)
    assert tokens == reference[0]
    assert_logprobs_close(logprobs, reference[1])


def test_worker_whose_plugins_differ_stops_start_up_with_the_difference(
        tiny_llama: Path, tmp_path: Path) -> None:
    """The front end sees a plugin distribution that the worker process does not."""
    from engine.core.config import EngineConfig
    from engine.core.executor.mp import MultiprocExecutor
    from engine.core.startup import prepare
    from engine.testing.test_plugins import install_test_plugins

    target = install_test_plugins(tmp_path / "plugins", ("workers",))
    config = EngineConfig(model=str(tiny_llama), dtype="float32", num_kv_blocks=64,
                          distributed_executor_backend="mp")
    saved = list(sys.path)
    # Only this test's plugin directory, and only for the front end: other modules' fixtures
    # may have left the whole test-plugin set on sys.path.
    sys.path[:] = [p for p in saved if not any(Path(p).glob("engine_test_plugin_*"))]
    try:
        sys.path.insert(0, str(target))
        setup = prepare(config)  # the front end's manifest names engine-test-plugin-workers
        sys.path.remove(str(target))
        assert any(e.distribution == "engine-test-plugin-workers"
                   for e in setup.manifest.entries)
        with pytest.raises(RuntimeError) as info:
            MultiprocExecutor(setup, eos_token_id=None)  # the worker is spawned without it
    finally:
        sys.path[:] = saved
    message = str(info.value)
    assert message.startswith("worker rank 0 failed to start: PluginError: ")
    assert "the worker rank 0 process does not have the same plugins as the front end" in message
    assert ("engine.worker_extensions:test_inspect from engine-test-plugin-workers 0.1.0 is "
            "not installed here") in message


async def test_async_llm_collective_rpc_in_process(tiny_llama: Path, plugins_path: Path) -> None:
    from engine.core.client.async_llm import AsyncLLM, in_process_client
    from engine.core.config import EngineConfig

    config = EngineConfig(model=str(tiny_llama), dtype="float32", num_kv_blocks=32,
                          plugins="engine-test-plugin-workers",
                          worker_extensions=("test_inspect",))
    llm = AsyncLLM(config, client=in_process_client, log_stats=False)
    await llm.start()
    try:
        [info] = await llm.collective_rpc("worker_info")
        assert (info["rank"], info["world_size"]) == (0, 1)
        with pytest.raises(CollectiveRpcError, match="failed on worker rank 0.*test_inspect"):
            await llm.collective_rpc("fail", ["no"])
        assert await llm.is_healthy()
    finally:
        await llm.shutdown()


def test_a_local_ray_start_that_times_out_is_retried_once(monkeypatch: pytest.MonkeyPatch,
                                                          ) -> None:
    """Ray's raylet must register within a fixed 30 s; a slow first start gets a second go."""
    from engine.core.executor.ray_executor import RayExecutor

    class FakeRay:
        def __init__(self, failures: int) -> None:
            self.failures, self.calls, self.shutdowns = failures, 0, 0

        def is_initialized(self) -> bool:
            return False

        def init(self, **kwargs: Any) -> None:
            self.calls += 1
            if self.calls <= self.failures:
                raise Exception("The current node timed out during startup. ...")

        def shutdown(self) -> None:
            self.shutdowns += 1

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    executor = RayExecutor.__new__(RayExecutor)
    executor.world_size = 2
    executor.ray = FakeRay(failures=1)
    executor._init_ray()
    assert (executor.ray.calls, executor.ray.shutdowns) == (2, 1)
    executor.ray = FakeRay(failures=2)
    with pytest.raises(Exception, match="timed out during startup"):
        executor._init_ray()


def test_a_timed_out_ray_start_s_processes_are_reaped_before_any_collection(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's Node holds its processes in reference cycles that the failed start drops; a
    collection running before the reaping (any allocation may start one) would warn
    "subprocess N is still running" (failing this test) and leave the process to nobody."""
    import subprocess

    from engine.core.executor.ray_executor import RayExecutor

    pids: list[int] = []

    class Node:  # a cycle holding the process, as Ray's Node and its ProcessInfo do
        def __init__(self, process: subprocess.Popen[bytes]) -> None:
            self.me, self.process = self, process

    class FakeRay:
        calls = 0

        def is_initialized(self) -> bool:
            return False

        def init(self, **kwargs: Any) -> None:
            self.calls += 1
            if self.calls == 1:
                process = subprocess.Popen(
                    [sys.executable, "-c", "import time; time.sleep(60)", "/x/ray/raylet"])
                pids.append(process.pid)
                Node(process)  # dropped at once: garbage only a collection finds
                del process
                raise Exception("The current node timed out during startup. ...")

        def shutdown(self) -> None:
            for _ in range(100):
                [object()]  # allocations, each of which may start a collection

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    threshold = gc.get_threshold()
    # A full collection at every allocation, where collecting is on (with the heap frozen,
    # the oldest generation's "enough new objects" test always passes).
    gc.freeze()
    gc.set_threshold(1, 1, 1)
    try:
        executor = RayExecutor.__new__(RayExecutor)
        executor.world_size = 2
        executor.ray = FakeRay()
        executor._init_ray()
        assert executor.ray.calls == 2 and gc.isenabled()
        with pytest.raises(ProcessLookupError):  # killed and reaped by the executor
            os.kill(pids[0], 0)
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids[0], signal.SIGKILL)


def test_a_failed_ray_start_leaves_no_process_of_its_own_running() -> None:
    """What a failed start spawned (Ray's GCS, raylet) is killed and reaped; nothing else."""
    import subprocess
    import sys

    from engine.core.executor.ray_executor import _forget_killed_processes

    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    rays = subprocess.Popen([*sleep, "/x/ray/core/src/ray/raylet/raylet"])
    other = subprocess.Popen(sleep)
    try:
        _forget_killed_processes()
        assert rays.returncode is not None  # killed and waited for: no ResourceWarning later
        assert other.poll() is None  # not one of Ray's: untouched
    finally:
        for process in (rays, other):
            process.kill()
            process.wait()
