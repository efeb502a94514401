"""Scheduling policies: built-in order and victims, and a custom policy reached."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from engine.core.plugins import Allowlist, PluginCatalog
from engine.core.scheduler import FCFSPolicy, PriorityPolicy, Request, Scheduler
from engine.sdk import (
    EngineRequest,
    ModelRunnerOutput,
    RequestStatus,
    RequestView,
    SamplingParams,
    SchedulerContext,
    SchedulerState,
    SchedulingPolicy,
    SchedulingPolicyContext,
)
from engine.sdk.groups import SCHEDULERS, SCHEDULING_POLICIES


def make_scheduler(policy: SchedulingPolicy | None, **overrides: Any) -> Scheduler:
    values: dict[str, Any] = dict(
        block_size=4,
        num_kv_blocks=32,
        max_num_seqs=1,
        max_num_batched_tokens=64,
        max_model_len=32,
    )
    values.update(overrides)
    return Scheduler(SchedulerContext(plugin_name="default", policy=policy, **values))


def ctx() -> SchedulingPolicyContext:
    return SchedulingPolicyContext(plugin_name="test")


def add(scheduler: Scheduler, request_id: str, num_prompt_tokens: int = 3, **fields: Any) -> None:
    max_tokens = fields.pop("max_tokens", 2)
    scheduler.add_request(
        EngineRequest(
            request_id,
            tuple(range(1, num_prompt_tokens + 1)),
            SamplingParams(max_tokens=max_tokens),
            **fields,
        )
    )


def admission_order(scheduler: Scheduler, max_steps: int = 500) -> list[str]:
    """Run to completion with a runner that samples token 7; ids in order of admission."""
    admitted: list[str] = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        admitted += [new.req_id for new in out.scheduled_new_reqs if new.req_id not in admitted]
        sampled = []
        for req_id in out.num_scheduled_tokens:
            request = scheduler.get_request(req_id)
            assert request is not None
            sampled.append((7,) if request.num_computed_tokens == request.num_tokens else ())
        runner = ModelRunnerOutput(tuple(out.num_scheduled_tokens), tuple(sampled))
        scheduler.update_from_output(out, runner)
    scheduler.schedule()
    assert scheduler.num_free_blocks == scheduler.ctx.num_kv_blocks
    return admitted


def view(request_id: str, priority: int = 0, arrival_time: float = 0.0) -> Request:
    engine_request = EngineRequest(
        request_id, (1,), SamplingParams(), priority=priority, arrival_time=arrival_time
    )
    return Request(engine_request, max_model_len=32)


def test_fcfs_orders_by_arrival_then_insertion() -> None:
    scheduler = make_scheduler(None)
    assert isinstance(scheduler.policy, FCFSPolicy)
    add(scheduler, "late", arrival_time=5.0)
    add(scheduler, "early", arrival_time=1.0)
    add(scheduler, "tie-1", arrival_time=3.0)
    add(scheduler, "tie-2", arrival_time=3.0)
    assert admission_order(scheduler) == ["early", "tie-1", "tie-2", "late"]


def test_priority_orders_by_priority_then_arrival() -> None:
    scheduler = make_scheduler(PriorityPolicy(ctx()))
    add(scheduler, "p2", priority=2, arrival_time=0.0)
    add(scheduler, "p0-late", priority=0, arrival_time=9.0)
    add(scheduler, "p1", priority=1, arrival_time=1.0)
    add(scheduler, "p0", priority=0, arrival_time=4.0)
    assert admission_order(scheduler) == ["p0", "p0-late", "p1", "p2"]


def test_builtin_victims() -> None:
    a, b, c, d = view("a", 1, 1.0), view("b", 0, 5.0), view("c", 1, 0.5), view("d", 0, 5.0)
    fcfs, priority = FCFSPolicy(ctx()), PriorityPolicy(ctx())
    assert fcfs.select_preemption_victim([a, b, c, d]) is d  # latest arrival, last on ties
    assert priority.select_preemption_victim([a, b, c, d]) is a  # largest (priority, arrival)
    assert priority.select_preemption_victim([b, d]) is d


def test_priority_preempts_the_least_urgent_running_request() -> None:
    scheduler = make_scheduler(
        PriorityPolicy(ctx()), num_kv_blocks=4, max_model_len=16, max_num_seqs=4
    )
    add(scheduler, "urgent", 4, priority=0, max_tokens=12)
    add(scheduler, "lazy", 4, priority=5, max_tokens=12)
    preempted: list[str] = []
    for _ in range(40):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        preempted += out.preempted_req_ids
        sampled = [(7,) for _ in out.num_scheduled_tokens]
        scheduler.update_from_output(
            out, ModelRunnerOutput(tuple(out.num_scheduled_tokens), tuple(sampled))
        )
    assert preempted and set(preempted) == {"lazy"}


class Recording(SchedulingPolicy):
    """Shortest prompt first, at most two running; records every call."""

    name = "recording"

    def __init__(self, ctx: SchedulingPolicyContext) -> None:
        super().__init__(ctx)
        self.calls: list[tuple[str, str]] = []
        self.states: list[SchedulerState] = []

    def sort_key(self, request: RequestView) -> tuple[Any, ...]:
        self.calls.append(("sort_key", request.request_id))
        return (request.num_prompt_tokens,)

    def can_admit(self, request: RequestView, state: SchedulerState) -> bool:
        self.calls.append(("can_admit", request.request_id))
        self.states.append(state)
        return state.num_running < 2

    def select_preemption_victim(self, running: Sequence[RequestView]) -> RequestView:
        self.calls.append(("victim", running[-1].request_id))
        return running[-1]


def test_custom_policy_is_reached_and_obeyed() -> None:
    policy = Recording(ctx())
    scheduler = make_scheduler(policy, max_num_seqs=8)
    for request_id, length in (("long", 9), ("short", 2), ("mid", 5)):
        add(scheduler, request_id, length)
    assert [c for c in policy.calls if c[0] == "sort_key"] == [
        ("sort_key", "long"),
        ("sort_key", "short"),
        ("sort_key", "mid"),
    ]
    out = scheduler.schedule()
    assert [new.req_id for new in out.scheduled_new_reqs] == ["short", "mid"]  # then refused
    assert ("can_admit", "long") in policy.calls
    state = policy.states[0]
    assert (state.num_running, state.num_waiting, state.token_budget) == (0, 3, 64)
    assert policy.states[1].num_scheduled_tokens == 2


def test_custom_victim_is_used_and_a_wrong_one_is_an_error() -> None:
    policy = Recording(ctx())
    scheduler = make_scheduler(policy, num_kv_blocks=4, max_model_len=16, max_num_seqs=8)
    add(scheduler, "a", 4, max_tokens=10)
    add(scheduler, "b", 4, max_tokens=10)
    assert admission_order(scheduler)
    assert any(call[0] == "victim" for call in policy.calls)

    class Wrong(Recording):
        def select_preemption_victim(self, running: Sequence[RequestView]) -> RequestView:
            return view("ghost")

    scheduler = make_scheduler(Wrong(ctx()), num_kv_blocks=4, max_model_len=16, max_num_seqs=8)
    add(scheduler, "a", 4, max_tokens=10)
    add(scheduler, "b", 4, max_tokens=10)
    with pytest.raises(RuntimeError, match="chose 'ghost' as preemption victim"):
        admission_order(scheduler)


def test_a_policy_error_propagates() -> None:
    class Boom(FCFSPolicy):
        def can_admit(self, request: RequestView, state: SchedulerState) -> bool:
            raise LookupError(f"reached for {request.request_id}")

    scheduler = make_scheduler(Boom(ctx()))
    add(scheduler, "a")
    with pytest.raises(LookupError, match="reached for a"):
        scheduler.schedule()
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.num_free_blocks == 32


def test_builtins_are_registered_entry_points() -> None:
    catalog = PluginCatalog.discover(Allowlist.parse(None))
    assert catalog.load(SCHEDULERS, "default") is Scheduler
    assert catalog.load(SCHEDULING_POLICIES, "fcfs") is FCFSPolicy
    assert catalog.load(SCHEDULING_POLICIES, "priority") is PriorityPolicy
