"""acme_shortest_job: its decisions, driven directly, and the default scheduler keeping every
invariant with it; in an engine it is asked only when selected."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from acme_engine_plugins.policy import ShortestJobFirst

from engine.sdk import (
    RequestStatus,
    SamplingParams,
    SchedulerContext,
    SchedulingPolicyContext,
)
from engine.testing.contracts import check_scheduler


@dataclass(frozen=True)
class View:  # satisfies engine.sdk.RequestView
    request_id: str
    num_prompt_tokens: int
    num_tokens: int
    arrival_time: float
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    prompt_token_ids: tuple[int, ...] = ()
    output_token_ids: tuple[int, ...] = ()
    num_computed_tokens: int = 0
    priority: int = 0
    status: RequestStatus = RequestStatus.WAITING


def policy(**options: Any) -> ShortestJobFirst:
    return ShortestJobFirst(SchedulingPolicyContext(options=ShortestJobFirst.Options(**options)))


def test_shortest_job_first_and_most_work_left_preempted() -> None:
    sjf = policy(unbounded_tokens=1000)
    long_prompt = View("a", 50, 50, 1.0, SamplingParams(max_tokens=10))
    long_answer = View("b", 5, 5, 2.0, SamplingParams(max_tokens=100))
    unbounded = View("c", 5, 5, 0.5, SamplingParams(max_tokens=None))
    tie = View("d", 50, 50, 3.0, SamplingParams(max_tokens=10))
    assert sorted([unbounded, tie, long_answer, long_prompt], key=sjf.sort_key) == [
        long_prompt, tie, long_answer, unbounded]
    halfway = View("e", 5, 60, 0.0, SamplingParams(max_tokens=100))  # 45 left
    assert sjf.select_preemption_victim([long_prompt, halfway, long_answer]) is long_answer


def test_the_default_scheduler_with_it_conforms() -> None:  # needs engine-core too
    from engine.core.scheduler import Scheduler

    def with_policy(ctx: SchedulerContext) -> Scheduler:
        sjf = ShortestJobFirst(SchedulingPolicyContext(
            options=ShortestJobFirst.Options(), max_num_seqs=ctx.max_num_seqs,
            max_num_batched_tokens=ctx.max_num_batched_tokens, num_kv_blocks=ctx.num_kv_blocks))
        return Scheduler(replace(ctx, policy=sjf))

    assert check_scheduler(with_policy).num_preempted > 0


def test_the_engine_asks_it_only_when_selected(
    tiny_qwen3: Path, make_llm: Callable[..., Any], spy: Callable[..., Any],
    greedy: Callable[..., Any], prompts: list[list[int]], qwen3_tokens: list[list[int]],
) -> None:
    calls = spy(ShortestJobFirst, "sort_key")
    with make_llm(tiny_qwen3) as llm:
        greedy(llm, prompts[:1], max_tokens=2)
    assert calls["sort_key"] == 0
    with make_llm(tiny_qwen3, scheduling_policy="acme_shortest_job", max_num_seqs=1) as llm:
        assert greedy(llm, prompts) == qwen3_tokens
    assert calls["sort_key"] >= len(prompts)
