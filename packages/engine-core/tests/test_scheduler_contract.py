"""The published scheduler conformance suite: the default scheduler passes, broken ones fail."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import pytest

from engine.core.scheduler import FCFSPolicy, PriorityPolicy, Scheduler
from engine.sdk import (
    EngineCoreOutput,
    ModelRunnerOutput,
    RequestStatus,
    SchedulerContext,
    SchedulerOutput,
    SchedulingPolicyContext,
)
from engine.testing.contracts import check_scheduler


@pytest.mark.parametrize("policy", [None, FCFSPolicy, PriorityPolicy])
def test_default_scheduler_conforms(policy: type | None) -> None:
    def make(ctx: SchedulerContext) -> Scheduler:
        chosen = None if policy is None else policy(SchedulingPolicyContext(plugin_name="p"))
        return Scheduler(dataclasses.replace(ctx, policy=chosen))

    report = check_scheduler(make)
    assert len(report.scenarios) == 10
    # Every path was reached, so the suite cannot pass vacuously.
    assert report.num_preempted > 0 and report.num_partial_chunks > 0
    assert report.num_prefix_cache_hit_tokens > 0
    assert check_scheduler(Scheduler, seeds=range(0)).num_requests > 0  # the class itself


class OverBudget(Scheduler):
    """Schedules up to 4 tokens more than its context allows."""

    def schedule(self) -> SchedulerOutput:
        real = self.ctx
        self.ctx = dataclasses.replace(real, max_num_batched_tokens=real.max_num_batched_tokens + 4)
        try:
            return super().schedule()
        finally:
            self.ctx = real


class ForgetsFinished(Scheduler):
    """Never tells the worker which requests finished."""

    def schedule(self) -> SchedulerOutput:
        return dataclasses.replace(super().schedule(), finished_req_ids=frozenset())


class IgnoresAborts(Scheduler):
    """Keeps running aborted requests."""

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        if status is not RequestStatus.FINISHED_ABORTED:
            super().finish_requests(request_ids, status)


class IgnoresStopTokens(Scheduler):
    """Only ever stops at max_tokens."""

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        for request_id in scheduler_output.num_scheduled_tokens:
            request = self.get_request(request_id)
            if request is not None:
                request._stops_on_eos = False
                request._stop_token_ids = frozenset()
        return super().update_from_output(scheduler_output, runner_output)


class ScrambledBlockTables(Scheduler):
    """Sends new requests their block ids in reverse order."""

    def schedule(self) -> SchedulerOutput:
        out = super().schedule()
        return dataclasses.replace(out, scheduled_new_reqs=tuple(
            dataclasses.replace(new, block_ids=tuple(reversed(new.block_ids)))
            for new in out.scheduled_new_reqs))


@pytest.mark.parametrize(("broken", "message"), [
    (OverBudget, "tokens scheduled, the budget is"),
    (ForgetsFinished, "sent as a new request while the worker still has it|still holds"),
    (IgnoresAborts, "after it finished"),
    (IgnoresStopTokens, "stop conditions"),
    (ScrambledBlockTables, "KV slot"),
])
def test_broken_schedulers_fail_with_the_rule_they_break(broken: type[Scheduler],
                                                         message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        check_scheduler(broken)
