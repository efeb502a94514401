"""The frozen SDK 1.0 plugins that EngineCore runs: schedulers, policies, KV connectors.

Each of ``engine-test-plugin-sdk1``'s is reached when selected (through the engine, and
through its SDK contract or the contract suites of ``engine.testing.contracts``) and
untouched otherwise. See ``test_sdk1_distribution.py`` for what these tests prove and why
the plugin is never edited.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydantic
import pytest
import torch

from engine.core import LLM
from engine.sdk import (
    CachedRequestData,
    KVConnectorContext,
    KVConnectorRole,
    NewRequestData,
    RequestStatus,
    SamplingParams,
    SchedulerOutput,
)
from engine.sdk import groups as sdk_groups
from engine.testing.contracts import (
    check_kv_connector,
    check_scheduler,
)
from engine.testing.engine import assert_kv_pool_full
from engine.testing.sdk1 import (
    GREEDY,
    PROMPTS,
    counting,
    greedy,
    sdk1_catalog,
    sdk1_llm,
)

pytestmark = pytest.mark.filterwarnings("default::engine.sdk.deprecation.SDKDeprecationWarning")


def test_scheduler(tiny_llama: Path, sdk1: Path, reference: list[list[int]]) -> None:
    # 6 blocks of 16 tokens for three 52-token sequences: preemption by recompute.
    with counting() as calls, sdk1_llm(tiny_llama, scheduler="sdk1_fcfs", num_kv_blocks=6,
                                 max_model_len=64) as llm:
        assert type(llm.llm_engine.core.scheduler).__name__ == "Sdk1FCFSScheduler"
        assert greedy(llm) == reference
        assert_kv_pool_full(llm)
    assert calls["sdk1_fcfs.schedule"] > 0 and calls["sdk1_fcfs.preempt"] > 0
    with counting() as calls, sdk1_llm(tiny_llama) as llm:
        assert type(llm.llm_engine.core.scheduler).__name__ != "Sdk1FCFSScheduler"
        assert greedy(llm) == reference
    assert calls["sdk1_fcfs.schedule"] == 0
    report = check_scheduler(sdk1_catalog().load(sdk_groups.SCHEDULERS, "sdk1_fcfs"))
    assert report.num_preempted > 0 and report.num_partial_chunks > 0


def _finish_order(llm: LLM, prompts: dict[str, list[int]]) -> list[str]:
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    finished: list[str] = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert_kv_pool_full(llm)
    return finished


def test_scheduling_policy(tiny_llama: Path, sdk1: Path) -> None:
    prompts = {"long": list(range(10, 40)), "short": [3, 4], "medium": list(range(50, 60))}
    options = {"sdk1_shortest_first": {"max_running": 1}}  # one at a time, by its option
    with counting() as calls, sdk1_llm(tiny_llama, max_num_seqs=4, plugin_options=options,
                                 scheduling_policy="sdk1_shortest_first") as llm:
        assert _finish_order(llm, prompts) == ["short", "medium", "long"]
    assert calls["sdk1_shortest_first.sort_key"] >= 3
    assert calls["sdk1_shortest_first.can_admit"] >= 3
    with counting() as calls, sdk1_llm(tiny_llama, max_num_seqs=1) as llm:  # fcfs
        assert _finish_order(llm, prompts) == ["long", "short", "medium"]
    assert calls["sdk1_shortest_first.sort_key"] == 0


_NO_PARAMS = SamplingParams()


@dataclass(frozen=True)
class _View:
    """A request as the scheduler shows it (satisfies ``engine.sdk.RequestView``)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    num_computed_tokens: int = 0
    output_token_ids: tuple[int, ...] = ()
    sampling_params: SamplingParams = _NO_PARAMS
    priority: int = 0
    arrival_time: float = 0.0
    status: RequestStatus = RequestStatus.WAITING

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


def _step(request: _View, block_ids: tuple[int, ...], num_computed_tokens: int,
          num_tokens: int) -> SchedulerOutput:
    """A step that sends ``request`` as new and computes ``num_tokens`` more of it."""
    new = NewRequestData(request.request_id, request.prompt_token_ids, SamplingParams(),
                         block_ids, num_computed_tokens=num_computed_tokens)
    return SchedulerOutput((new,), CachedRequestData(), {request.request_id: num_tokens},
                           num_tokens)


def test_kv_connector_sides_exchange_metadata(sdk1: Path) -> None:
    cls = sdk1_catalog().load(sdk_groups.KV_CONNECTORS, "sdk1_store")
    layers = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")

    def context(role: KVConnectorRole) -> KVConnectorContext:
        return KVConnectorContext(plugin_name="sdk1_store", role=role, engine_id="e1",
                                  block_size=4, num_blocks=10, num_layers=2, layer_names=layers,
                                  num_kv_heads=2, head_size=8, kv_cache_dtype="float32")

    scheduler = cls.scheduler_cls(context(KVConnectorRole.SCHEDULER))
    worker = cls.worker_cls(context(KVConnectorRole.WORKER))
    caches = {name: torch.randn(2, 10, 4, 2, 8) for name in layers}  # block index: dim 1
    worker.register_kv_caches(caches)

    def run_step(meta: Any) -> None:  # the worker's part of one step, after the wire
        decoded = cls.metadata_cls.from_bytes(meta.to_bytes())
        assert decoded == meta
        worker.start_load_kv(decoded)
        for name in layers:
            worker.wait_for_layer_load(name)
            worker.save_kv_layer(name, caches[name], None)
        worker.wait_for_save()
        assert worker.get_finished(set()) == (set(), set())

    first = _View("first", tuple(range(100, 110)))  # 2 full blocks + 2 tokens
    assert scheduler.get_num_new_matched_tokens(first, 0) == (0, False)
    scheduler.update_state_after_alloc(first, [3, 5, 7], 0)
    meta = scheduler.build_connector_meta(_step(first, (3, 5, 7), 0, 10))
    assert list(meta.saves) == [3, 5] and meta.loads == {}
    first_keys = list(meta.saves.values())
    wire = json.loads(meta.to_bytes())  # the SDK's default wire format: JSON, bytes as text
    assert list(wire["saves"]) == ["3", "5"] and all(isinstance(k, str) for k in
                                                     wire["saves"].values())
    run_step(meta)
    assert scheduler.request_finished(first, [3, 5, 7]) == (
        False, {"sdk1_stored_blocks": 2, "engine_id": "e1"})
    saved = {name: cache[:, [3, 5]].clone() for name, cache in caches.items()}

    second = _View("second", (*range(100, 108), 1, 2, 3, 4, 5))  # same 2 blocks
    assert scheduler.get_num_new_matched_tokens(second, 0) == (8, False)
    assert scheduler.get_num_new_matched_tokens(second, 0) == (8, False)  # no side effects
    assert scheduler.get_num_new_matched_tokens(second, 4) == (4, False)
    scheduler.update_state_after_alloc(second, [2, 4, 6, 8], 8)
    meta = scheduler.build_connector_meta(_step(second, (2, 4, 6, 8), 8, 5))
    assert meta.loads == dict(zip((2, 4), first_keys, strict=True))
    assert list(meta.saves) == [6]  # its third block is new
    for cache in caches.values():
        cache[:, [2, 4]] = 0.0
    run_step(meta)
    for name, cache in caches.items():  # the stored blocks arrived in the new block ids
        assert torch.equal(cache[:, [2, 4]], saved[name])
    assert worker.steps_seen == [1, 2]
    empty = scheduler.build_connector_meta(_step(second, (2, 4, 6, 8), 13, 1))
    assert empty.loads == {} and empty.saves == {}  # per-step state was reset
    chunked = _View("chunked", tuple(range(200, 212)))  # 3 blocks, 5 tokens computed now
    scheduler.update_state_after_alloc(chunked, [1, 9], 0)
    meta = scheduler.build_connector_meta(_step(chunked, (1, 9), 0, 5))
    assert list(meta.saves) == [1]  # only the block whose KV is computed
    with pytest.raises(pydantic.ValidationError):  # a malformed payload fails loudly
        cls.metadata_cls.from_bytes(b'{"loads": {"0": "AA=="}}')  # block 0: the null block


def test_kv_connector_through_the_engine(tiny_llama: Path, sdk1: Path,
                                        reference: list[list[int]]) -> None:
    # Selected with kv_connector="sdk1_store": both sides run inside a real engine, and
    # the blocks it stored come back as cached tokens once the prefix cache is dropped.
    prompts = [{"prompt_token_ids": list(p)} for p in PROMPTS]
    with counting() as calls, sdk1_llm(tiny_llama, kv_connector="sdk1_store") as llm:
        assert greedy(llm) == reference
        assert llm.llm_engine.core.reset_prefix_cache()
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == reference
        assert [o.num_cached_tokens for o in outputs] == [0, 32, 16]  # its full blocks
        assert_kv_pool_full(llm)
    assert calls["sdk1_store.register_kv_caches"] == 1
    assert calls["sdk1_store.request_finished"] == 2 * len(PROMPTS)
    steps = calls["sdk1_store.build_connector_meta"]
    assert steps > 0 and calls["sdk1_store.start_load_kv"] == steps
    assert calls["sdk1_store.wait_for_save"] == steps
    assert calls["sdk1_store.save_kv_layer"] == calls["sdk1_store.wait_for_layer_load"] > 0
    assert calls["sdk1_store.update_state_after_alloc"] == 2 * len(PROMPTS)
    with counting() as calls, sdk1_llm(tiny_llama) as llm:  # allowed, not selected: never called
        assert greedy(llm) == reference
    assert not any(key.startswith("sdk1_store.") for key in calls)
    report = check_kv_connector(sdk1_catalog().load(sdk_groups.KV_CONNECTORS, "sdk1_store"))
    assert report.num_external_tokens > 0
