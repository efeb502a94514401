"""A third-party KV connector (``engine-test-plugin-kvconn``'s ``test_recorder``), installed.

Reached: every hook of both sides is called, in the SDK's per-step order, and the prompt
blocks it stores come back as cached tokens. Selective: an engine that does not select it
never calls it and gives the same tokens. Its asynchronous loads and delayed frees go
through the engine's real paths (here across two worker processes, whose reports rank 0
aggregates). Every failure names the plugin, its group and its distribution.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from engine.core import LLM, SamplingParams
from engine.sdk import PluginError, SchedulerStats
from engine.testing.engine import assert_kv_pool_full, tokens_and_cached

DIST = "engine-test-plugin-kvconn"
PROMPTS = (list(range(10, 60)), [*range(10, 40), 3, 4, 5], [7] * 20)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
IDENTITY = r"plugin 'test_recorder' \(group engine.kv_connectors, distribution " \
           r"engine-test-plugin-kvconn 0.1.0\)"


def make_llm(path: Path, **kwargs: Any) -> LLM:
    options: dict[str, Any] = {"dtype": "float32", "plugins": DIST, "num_kv_blocks": 64,
                               "in_process": True}
    options.update(kwargs)
    return LLM(str(path), **options)


def recorder(**options: Any) -> dict[str, Any]:
    return {"kv_connector": "test_recorder", "kv_connector_options": options}


def generate(llm: LLM, prompts: Sequence[Sequence[int]] = PROMPTS,
             ) -> tuple[list[list[int]], list[int]]:
    return tokens_and_cached(llm, prompts, GREEDY)


def settle(llm: LLM) -> None:
    """Step EngineCore until no finished request holds blocks for the connector."""
    core = llm.llm_engine.core
    for _ in range(100):
        if not core.has_work():
            break
        core.step()
    assert_kv_pool_full(llm)


@contextmanager
def calls() -> Iterator[Counter[str]]:
    from engine_test_plugin_kvconn import CALLS

    before = Counter(CALLS)
    diff: Counter[str] = Counter()
    yield diff
    diff.update({k: v - before[k] for k, v in CALLS.items() if v != before[k]})


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> list[list[int]]:
    with make_llm(tiny_llama, plugins="none") as llm:
        return generate(llm)[0]


def test_reached_in_order_and_its_blocks_come_back(
        tiny_llama: Path, plugins_on_path: Path, reference: list[list[int]]) -> None:
    with calls() as counted, make_llm(tiny_llama, **recorder()) as llm:
        assert generate(llm) == (reference, [0, 16, 0])
        assert llm.llm_engine.core.reset_prefix_cache()
        assert generate(llm) == (reference, [48, 32, 16])  # its store, not the cache
        assert_kv_pool_full(llm)
    steps = counted["scheduler.build_connector_meta"]
    assert steps > 0 and all(counted[f"worker.{hook}"] == steps for hook in (
        "start_load_kv", "wait_for_save", "get_finished"))  # once per step, every step
    assert counted["worker.wait_for_layer_load"] == counted["worker.save_kv_layer"]
    assert counted["worker.save_kv_layer"] % 2 == 0  # two attention layers per forward
    assert counted["scheduler.get_num_new_matched_tokens"] >= 6
    assert counted["scheduler.update_state_after_alloc"] == 6
    assert counted["scheduler.request_finished"] == 6
    for once in ("scheduler.__init__", "worker.__init__", "worker.register_kv_caches",
                 "scheduler.shutdown", "worker.shutdown"):
        assert counted[once] == 1, once


def test_selective_an_engine_without_it_never_calls_it(
        tiny_llama: Path, plugins_on_path: Path, reference: list[list[int]]) -> None:
    with calls() as counted, make_llm(tiny_llama) as llm:  # allowed, not selected
        assert generate(llm) == (reference, [0, 16, 0])
        assert llm.llm_engine.core.kv_connector is None
        assert llm.llm_engine.core.worker.kv_connector is None
    assert not counted


def hits(stats: SchedulerStats) -> tuple[tuple[int, int], tuple[int, int]]:
    """``((local queries, local hits), (connector queries, connector hits))``."""
    local, external = stats.prefix_cache, stats.connector_prefix_cache
    assert external is not None, "an engine with a connector reports its lookups"
    return (local.queries, local.hits), (external.queries, external.hits)


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_stats_count_local_and_connector_hits_once_each(
        tiny_llama: Path, plugins_on_path: Path, reference: list[list[int]],
        enable_prefix_caching: bool) -> None:
    """Local hits in ``prefix_cache``, the connector's in ``connector_prefix_cache``."""
    on = enable_prefix_caching
    with make_llm(tiny_llama, enable_prefix_caching=on, **recorder()) as llm:
        core = llm.llm_engine.core  # no stat logger drains them: counts since the last call
        assert generate(llm) == (reference, [0, 16 if on else 0, 0])
        # 103 prompt tokens; the connector is asked about the tokens past the local hits.
        assert hits(core.make_stats()) == (((103, 16) if on else (0, 0)), (103 - 16 * on, 0))
        assert core.reset_prefix_cache()
        assert generate(llm) == (reference, [48, 32, 16])
        # The second prompt's first block is a local hit when the first prompt, admitted
        # in the same step, brought it from the store into the prefix cache.
        assert hits(core.make_stats()) == (((103, 16), (87, 80)) if on else
                                           ((0, 0), (103, 96)))  # 96 = 48 + 32 + 16
    with make_llm(tiny_llama, enable_prefix_caching=on) as llm:  # no connector: no stats
        generate(llm)
        assert llm.llm_engine.core.make_stats().connector_prefix_cache is None


def test_async_loads_and_delayed_frees_on_every_rank(
        tiny_llama: Path, plugins_on_path: Path, tmp_path: Path,
        reference: list[list[int]]) -> None:
    events = tmp_path / "events.txt"
    with make_llm(tiny_llama, tensor_parallel_size=2,
                  **recorder(load_async=True, delay_free=True, events=str(events))) as llm:
        assert generate(llm) == (reference, [0, 16, 0])
        settle(llm)  # the delayed frees wait for the next step's get_finished
        assert llm.llm_engine.core.reset_prefix_cache()
        assert generate(llm) == (reference, [48, 32, 16])
        settle(llm)
    lines = events.read_text().splitlines()
    for rank in (0, 1):  # the worker side runs on every rank, in its own process
        mine = [line for line in lines if line.startswith("worker ") and f"rank={rank}" in line]
        assert any(" register_kv_caches " in line for line in mine)
        assert any(" wait_for_layer_load " in line for line in mine)
    assert len({line.split("pid=")[1] for line in lines if line.startswith("worker")}) == 2


@pytest.mark.parametrize(("hook", "where"), [
    ("__init__", "constructing its worker side RecorderWorker failed: RuntimeError"),
    ("register_kv_caches", "register_kv_caches raised RuntimeError"),
])
def test_start_up_failures_name_it(tiny_llama: Path, plugins_on_path: Path, hook: str,
                                   where: str) -> None:
    with pytest.raises(PluginError, match=f"{IDENTITY}: {where}"):
        make_llm(tiny_llama, **recorder(fail_in=hook))


REQUEST_HOOKS = ["get_num_new_matched_tokens", "update_state_after_alloc"]
STEP_HOOKS = ["build_connector_meta", "start_load_kv", "save_kv_layer", "get_finished"]


@pytest.mark.parametrize("hook", REQUEST_HOOKS + STEP_HOOKS)
def test_a_raising_hook_fails_only_its_requests_naming_it(
        tiny_llama: Path, plugins_on_path: Path, reference: list[list[int]], hook: str) -> None:
    """A per-request hook fails that request; a per-step hook the step's; the engine serves on."""
    with make_llm(tiny_llama, **recorder(fail_in=hook, fail_times=1)) as llm:
        outputs = llm.generate([{"prompt_token_ids": list(p)} for p in PROMPTS], GREEDY,
                               use_tqdm=False)
        failed = [i for i, o in enumerate(outputs) if o.outputs[0].finish_reason == "error"]
        assert failed == ([0] if hook in REQUEST_HOOKS else [0, 1, 2])
        for index, output in enumerate(outputs):
            completion = output.outputs[0]
            if index in failed:
                assert completion.error is not None and completion.token_ids == []
                assert re.fullmatch(f"{IDENTITY}: {hook} raised RuntimeError: test_recorder "
                                    f"failed in {hook}", completion.error.message)
            else:
                assert completion.token_ids == reference[index]
        settle(llm)  # every block is back in the pool
        assert generate(llm)[0] == reference  # the engine, and the connector, serve on


def test_bad_options_and_a_disallowed_connector_name_it(tiny_llama: Path,
                                                        plugins_on_path: Path) -> None:
    with pytest.raises(PluginError, match=f"{IDENTITY}: invalid --kv-connector-option"):
        make_llm(tiny_llama, **recorder(bogus=1))
    with pytest.raises(PluginError, match="'test_recorder'.*installed but not allowed"):
        make_llm(tiny_llama, plugins="none", **recorder())
