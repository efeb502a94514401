"""The default scheduler driving a KV connector's scheduler side (no model, a scripted one).

Covers what the scheduler promises a connector (the SDK's call order and arguments) and
what it does with the answers: external tokens counted as computed, asynchronous loads
parked until reported, delayed frees, aborts during loads, preemption, and blocks all
free at the end. The workers are scripted here; the engine-level paths are in
``test_kv_connector_offload.py`` and ``test_kv_connector_plugin.py``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import pytest
from pydantic import Field

from engine.core.scheduler import Scheduler
from engine.sdk import (
    EngineCoreOutput,
    EngineRequest,
    KVConnectorContext,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorScheduler,
    ModelRunnerOutput,
    RequestStatus,
    RequestView,
    SamplingParams,
    SchedulerContext,
    SchedulerOutput,
)

PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)


class StepMeta(KVConnectorMetadata):
    step: int = 0
    loads: dict[str, int] = Field(default_factory=dict)


class Scripted(KVConnectorScheduler):
    """Offers ``offers[request_id]`` tokens; records every call."""

    def __init__(self, offers: dict[str, int] | None = None, *, load_async: bool = False,
                 free_later: bool = False) -> None:
        super().__init__(KVConnectorContext(
            plugin_name="scripted", role=KVConnectorRole.SCHEDULER, engine_id="e",
            block_size=4, num_blocks=33, num_layers=1, num_kv_heads=1, head_size=4,
            kv_cache_dtype="float32"))
        self.offers = offers or {}
        self.load_async = load_async
        self.free_later = free_later
        self.calls: list[tuple[Any, ...]] = []
        self.step = 0
        self.loads: dict[str, int] = {}

    def get_num_new_matched_tokens(self, request: RequestView,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        self.calls.append(("match", request.request_id, num_computed_tokens))
        offered = max(0, self.offers.get(request.request_id, 0) - num_computed_tokens)
        return offered, self.load_async and offered > 0

    def update_state_after_alloc(self, request: RequestView, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        self.calls.append(("alloc", request.request_id, tuple(block_ids),
                           num_external_tokens, request.num_computed_tokens))
        if num_external_tokens:
            self.loads[request.request_id] = num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StepMeta:
        self.step += 1
        meta = StepMeta(step=self.step, loads=self.loads)
        self.loads = {}
        return meta

    def request_finished(self, request: RequestView, block_ids: Sequence[int],
                         ) -> tuple[bool, dict[str, Any] | None]:
        self.calls.append(("finished", request.request_id, tuple(block_ids)))
        return self.free_later, None


def make(connector: KVConnectorScheduler, **overrides: Any) -> Scheduler:
    values: dict[str, Any] = dict(block_size=4, num_kv_blocks=32, max_num_seqs=8,
                                  max_num_batched_tokens=64, max_model_len=64)
    values.update(overrides)
    return Scheduler(SchedulerContext(plugin_name="default", kv_connector=connector, **values))


def add(scheduler: Scheduler, request_id: str, prompt: Sequence[int],
        params: SamplingParams = PARAMS) -> None:
    scheduler.add_request(EngineRequest(request_id, tuple(prompt), params))


def step(scheduler: Scheduler, **runner: Any) -> tuple[SchedulerOutput, list[Any]]:
    """One step; every request that computed all its tokens samples token 7."""
    out = scheduler.schedule()
    req_ids = tuple(out.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.get_request(req_id)
        assert request is not None
        sampled.append((7,) if request.num_computed_tokens == request.num_tokens else ())
    return out, scheduler.update_from_output(
        out, ModelRunnerOutput(req_ids, tuple(sampled), **runner))


def drain(scheduler: Scheduler, **runner: Any) -> None:
    for _ in range(100):
        if not (scheduler.has_unfinished_requests() or scheduler.has_finished_requests()):
            break
        step(scheduler, **runner)
    assert scheduler.num_free_blocks == scheduler.ctx.num_kv_blocks
    assert not scheduler.has_finished_requests()


def test_external_tokens_count_as_computed_and_metadata_goes_every_step() -> None:
    connector = Scripted({"a": 8})
    scheduler = make(connector)
    add(scheduler, "a", range(10))
    out, _ = step(scheduler)
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 8 and out.num_scheduled_tokens == {"a": 2}
    assert connector.calls[:2] == [("match", "a", 0), ("alloc", "a", new.block_ids, 8, 0)]
    assert StepMeta.from_bytes(out.kv_connector_metadata or b"") == StepMeta(
        step=1, loads={"a": 8})
    out, outputs = step(scheduler)  # decode: no new admission, metadata still sent
    assert StepMeta.from_bytes(out.kv_connector_metadata or b"").loads == {}
    assert outputs[0].num_cached_tokens == 8
    drain(scheduler)
    (finished,) = [c for c in connector.calls if c[0] == "finished"]
    assert finished == ("finished", "a", new.block_ids)  # its blocks, before they were freed


def test_the_last_prompt_token_is_always_computed() -> None:
    connector = Scripted({"a": 8})
    scheduler = make(connector)
    add(scheduler, "a", range(8))  # the connector has the whole prompt
    out, _ = step(scheduler)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 7
    assert out.num_scheduled_tokens == {"a": 1}
    assert ("alloc", "a", out.scheduled_new_reqs[0].block_ids, 7, 0) in connector.calls
    drain(scheduler)


def test_local_hits_come_first_and_prompt_logprobs_skip_the_connector() -> None:
    connector = Scripted({"b": 12, "c": 12})
    scheduler = make(connector)
    add(scheduler, "a", range(10))
    drain(scheduler)
    add(scheduler, "b", range(14))  # 8 tokens hit locally, the connector adds 4
    out, _ = step(scheduler)
    assert ("match", "b", 8) in connector.calls
    assert out.scheduled_new_reqs[0].num_computed_tokens == 12
    drain(scheduler)
    add(scheduler, "c", range(14), SamplingParams(max_tokens=1, prompt_logprobs=1))
    out, _ = step(scheduler)
    assert not [c for c in connector.calls if c[:2] == ("match", "c")]
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    drain(scheduler)


def test_async_load_parks_the_request_until_the_workers_report_it() -> None:
    connector = Scripted({"a": 8}, load_async=True)
    scheduler = make(connector)
    add(scheduler, "a", range(10))
    add(scheduler, "twin", range(10))  # same prompt, no offer: must not hit the loading blocks
    out, _ = step(scheduler)
    assert "a" not in out.num_scheduled_tokens
    assert StepMeta.from_bytes(out.kv_connector_metadata or b"").loads == {"a": 8}
    assert out.scheduled_new_reqs[0].req_id == "twin"
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0  # no hit on unloaded blocks
    assert scheduler.num_waiting_reqs == 1 and scheduler.get_num_unfinished_requests() == 2
    out, _ = step(scheduler)  # the load is still in flight
    assert "a" not in out.num_scheduled_tokens
    step(scheduler, finished_recving=frozenset({"a", "unknown"}))
    out, _ = step(scheduler)
    (new,) = out.scheduled_new_reqs
    assert (new.req_id, new.num_computed_tokens, out.num_scheduled_tokens["a"]) == ("a", 8, 2)
    assert len([c for c in connector.calls if c[:2] == ("alloc", "a")]) == 1
    drain(scheduler)


def test_abort_during_an_async_load_holds_the_blocks_until_it_is_reported() -> None:
    connector = Scripted({"a": 8}, load_async=True)
    scheduler = make(connector)
    add(scheduler, "a", range(10))
    step(scheduler)
    held = scheduler.ctx.num_kv_blocks - scheduler.num_free_blocks
    assert held == 2
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert [c[:2] for c in connector.calls if c[0] == "finished"] == [("finished", "a")]
    assert not scheduler.has_unfinished_requests() and scheduler.has_finished_requests()
    out, _ = step(scheduler)
    assert "a" in out.finished_req_ids  # the workers learn of it at once
    assert scheduler.ctx.num_kv_blocks - scheduler.num_free_blocks == held  # still loading
    with pytest.raises(ValueError, match="already in the scheduler"):
        add(scheduler, "a", range(10))  # its blocks are still taken under that id
    step(scheduler, finished_recving=frozenset({"a"}))
    assert scheduler.num_free_blocks == scheduler.ctx.num_kv_blocks
    assert not scheduler.has_finished_requests()


def test_request_finished_true_holds_blocks_until_finished_sending() -> None:
    connector = Scripted(free_later=True)
    scheduler = make(connector)
    add(scheduler, "a", range(6))
    add(scheduler, "never-scheduled", range(6))
    scheduler.finish_requests(["never-scheduled"], RequestStatus.FINISHED_ABORTED)
    for _ in range(3):
        step(scheduler)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.has_finished_requests()  # keep stepping: blocks wait for the send
    assert scheduler.num_free_blocks == scheduler.ctx.num_kv_blocks - 2
    step(scheduler)
    assert scheduler.num_free_blocks == scheduler.ctx.num_kv_blocks - 2
    step(scheduler, finished_sending=frozenset({"a"}))
    assert scheduler.num_free_blocks == scheduler.ctx.num_kv_blocks
    assert not scheduler.has_finished_requests()


def test_preempted_requests_ask_the_connector_again() -> None:
    connector = Scripted({"a": 4, "b": 4})
    scheduler = make(connector, num_kv_blocks=6, max_model_len=20)
    add(scheduler, "a", range(10), SamplingParams(max_tokens=8, ignore_eos=True))
    add(scheduler, "b", range(50, 60), SamplingParams(max_tokens=8, ignore_eos=True))
    preempted: set[str] = set()
    for _ in range(60):
        if not scheduler.has_unfinished_requests():
            break
        out, _ = step(scheduler)
        preempted |= out.preempted_req_ids
    assert preempted
    victim = next(iter(preempted))
    assert len([c for c in connector.calls if c[:2] == ("alloc", victim)]) >= 2
    drain(scheduler)


def test_parked_requests_give_their_blocks_back_when_nothing_else_can_run() -> None:
    # 4 blocks of 4 tokens. "b" runs; "a" loads 8 tokens asynchronously (2 blocks) and,
    # loaded, waits holding them; "b" outgrows the pool and preempts itself, and is then
    # first in line with only 2 free blocks for its 9 tokens while nothing runs. The
    # scheduler must hand back "a"'s parked blocks instead of waiting forever.
    connector = Scripted({"a": 8}, load_async=True)
    scheduler = make(connector, num_kv_blocks=4, max_model_len=16)
    add(scheduler, "b", range(50, 54), SamplingParams(max_tokens=12, ignore_eos=True))
    step(scheduler)
    add(scheduler, "a", range(9), SamplingParams(max_tokens=3, ignore_eos=True))
    preempted: set[str] = set()
    for _ in range(80):
        if not scheduler.has_unfinished_requests():
            break
        out, _ = step(scheduler, finished_recving=frozenset({"a"}))
        preempted |= out.preempted_req_ids
    assert not scheduler.has_unfinished_requests() and preempted == {"b"}
    assert len([c for c in connector.calls if c[:2] == ("alloc", "a")]) == 2  # asked again
    drain(scheduler)


@pytest.mark.parametrize(("result", "message"), [
    ((-1, False), "must return .num_tokens: int >= 0"),
    ((True, False), "must return .num_tokens: int >= 0"),
    (3, "must return .num_tokens: int >= 0"),
])
def test_bad_answers_fail_the_request_naming_the_connector(result: Any, message: str) -> None:
    connector = Scripted()
    connector.get_num_new_matched_tokens = lambda request, n: result  # type: ignore[method-assign]
    scheduler = make(connector)
    add(scheduler, "a", range(6))
    [failed] = failed_outputs(scheduler)
    assert failed.request_id == "a" and failed.error is not None
    assert re.search(message, failed.error.message)
    assert (failed.error.plugin, failed.error.group) == ("scripted", "engine.kv_connectors")


def failed_outputs(scheduler: Scheduler) -> list[EngineCoreOutput]:
    """One step that runs nothing: the requests a connector call failed, and a full pool."""
    out = scheduler.schedule()
    assert not out.num_scheduled_tokens
    outputs = scheduler.update_from_output(out, ModelRunnerOutput((), ()))
    assert all(o.finish_reason == "error" for o in outputs)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.num_free_blocks == scheduler.ctx.num_kv_blocks
    return outputs


def test_a_raising_step_hook_fails_the_steps_requests_naming_hook_and_connector() -> None:
    connector = Scripted()

    def broken(scheduler_output: SchedulerOutput) -> StepMeta:
        raise OSError("disk full")

    connector.build_connector_meta = broken  # type: ignore[method-assign]
    scheduler = make(connector)
    add(scheduler, "a", range(6))
    add(scheduler, "b", range(20, 26))
    failed = failed_outputs(scheduler)
    assert sorted(o.request_id for o in failed) == ["a", "b"]
    assert all(o.error is not None and o.error.message.endswith(
        "build_connector_meta raised OSError: disk full") for o in failed)
    connector.build_connector_meta = lambda out: "not metadata"  # type: ignore[method-assign,assignment,return-value]
    add(scheduler, "c", range(6))
    [failed_c] = failed_outputs(scheduler)
    assert failed_c.error is not None and "not a KVConnectorMetadata" in failed_c.error.message
