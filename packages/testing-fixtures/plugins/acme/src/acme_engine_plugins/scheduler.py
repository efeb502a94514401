"""``engine.schedulers`` entry ``acme_lazy``: blocks on demand, preemption by recompute.

A whole scheduler in ~200 lines, for engines that want none of the default scheduler's
machinery (no prefix cache, no KV connector): each step it first continues the running
requests in admission order, giving each the blocks its new tokens need and, when none are
free, preempting a request not yet scheduled in this step (the scheduling policy's
``select_preemption_victim``; the newest without one); then, if nothing was preempted, it
admits waiting requests in the policy's ``sort_key`` order (arrival order without one)
while blocks, the token budget, ``max_num_seqs`` and the policy's ``can_admit`` allow.
Prompts are split across steps when chunked prefill is on.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from engine.sdk import (
    CachedRequestData,
    EngineCoreOutput,
    EngineRequest,
    ModelRunnerOutput,
    NewRequestData,
    RequestStatus,
    SampleLogprobs,
    SamplingParams,
    SchedulerContext,
    SchedulerInterface,
    SchedulerOutput,
    SchedulerState,
    SchedulerStats,
    ValidationError,
)


@dataclass(eq=False)
class _Request:
    """A request inside the scheduler; satisfies ``engine.sdk.RequestView``."""

    req: EngineRequest
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    order: tuple[Any, ...] = ()  # position in the waiting queue

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        return self.req.prompt_token_ids

    @property
    def sampling_params(self) -> SamplingParams:
        return self.req.sampling_params

    @property
    def priority(self) -> int:
        return self.req.priority

    @property
    def arrival_time(self) -> float:
        return self.req.arrival_time

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.req.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.req.prompt_token_ids) + len(self.output_token_ids)


class LazyScheduler(SchedulerInterface):
    """Blocks allocated as tokens are computed; preemption by recompute; honours the policy."""

    def __init__(self, ctx: SchedulerContext) -> None:
        super().__init__(ctx)
        if ctx.kv_connector is not None:
            raise ValidationError("the acme_lazy scheduler cannot drive a KV connector; use "
                                  "the default scheduler with --kv-connector")
        self.free_block_ids = list(range(ctx.num_kv_blocks, 0, -1))  # pop() gives 1 first
        self.requests: dict[str, _Request] = {}
        self.waiting: list[_Request] = []  # sorted by .order
        self.running: list[_Request] = []  # admission order
        self.finished_req_ids: set[str] = set()
        self.num_preempted = 0
        self._arrivals = itertools.count()

    # -- requests in and out --------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} is already scheduled")
        self.requests[request.request_id] = r = _Request(request)
        self._enqueue(r)

    def _enqueue(self, r: _Request) -> None:
        policy = self.ctx.policy
        key = policy.sort_key(r) if policy is not None else ()
        r.status, r.order = RequestStatus.WAITING, (*key, next(self._arrivals))
        bisect.insort(self.waiting, r, key=lambda x: x.order)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        for req_id in request_ids:
            r = self.requests.get(req_id)
            if r is not None:
                self._finish(r, status)

    def _finish(self, r: _Request, status: RequestStatus) -> None:
        r.status = status
        self._release(r)
        del self.requests[r.request_id]
        if r in self.running:
            self.running.remove(r)
        else:
            self.waiting.remove(r)
        self.finished_req_ids.add(r.request_id)  # the workers drop it (or never had it)

    def _release(self, r: _Request) -> None:
        self.free_block_ids.extend(reversed(r.block_ids))
        r.block_ids, r.num_computed_tokens = [], 0

    # -- one step -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.ctx.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        cached: list[tuple[str, tuple[int, ...], int]] = []
        preempted: set[str] = set()
        for r in list(self.running):
            if budget == 0:
                break
            if r.request_id in preempted:
                continue
            n = min(r.num_tokens - r.num_computed_tokens, budget)
            new_blocks = self._grow(r, n, num_scheduled, preempted)
            if new_blocks is None:
                continue  # r itself was preempted
            num_scheduled[r.request_id] = n
            budget -= n
            cached.append((r.request_id, new_blocks, r.num_computed_tokens))
        new_reqs = [] if preempted else self._admit(budget, num_scheduled)
        finished, self.finished_req_ids = frozenset(self.finished_req_ids), set()
        ids, blocks, computed = zip(*cached, strict=True) if cached else ((), (), ())
        return SchedulerOutput(
            tuple(new_reqs), CachedRequestData(tuple(ids), tuple(blocks), tuple(computed)),
            num_scheduled, sum(num_scheduled.values()), finished_req_ids=finished,
            preempted_req_ids=frozenset(preempted))

    def _blocks_for(self, r: _Request, num_new_tokens: int) -> int:
        end = r.num_computed_tokens + num_new_tokens
        return -(-end // self.ctx.block_size) - len(r.block_ids)

    def _grow(self, r: _Request, n: int, scheduled: dict[str, int],
              preempted: set[str]) -> tuple[int, ...] | None:
        """Give ``r`` the blocks for ``n`` more tokens, preempting others; None: r preempted."""
        needed = self._blocks_for(r, n)
        while needed > len(self.free_block_ids):
            candidates = [x for x in self.running if x.request_id not in scheduled]
            policy = self.ctx.policy
            victim = candidates[-1] if policy is None else self.requests[
                policy.select_preemption_victim(candidates).request_id]
            self._preempt(victim, preempted)
            if victim is r:
                return None
        new = tuple(self.free_block_ids.pop() for _ in range(needed))
        r.block_ids.extend(new)
        return new

    def _preempt(self, r: _Request, preempted: set[str]) -> None:
        self.running.remove(r)
        self._release(r)
        preempted.add(r.request_id)
        self.num_preempted += 1
        self._enqueue(r)

    def _admit(self, budget: int, scheduled: dict[str, int]) -> list[NewRequestData]:
        new_reqs = []
        policy = self.ctx.policy
        while self.waiting and budget > 0 and len(self.running) < self.ctx.max_num_seqs:
            r = self.waiting[0]
            n = min(r.num_tokens, budget)
            if n < r.num_tokens and not self.ctx.enable_chunked_prefill:
                break  # whole prompts only
            needed = self._blocks_for(r, n)
            if needed > len(self.free_block_ids):
                break  # head of line waits for blocks
            state = SchedulerState(
                num_running=len(self.running), num_waiting=len(self.waiting),
                num_free_blocks=len(self.free_block_ids),
                num_total_blocks=self.ctx.num_kv_blocks,
                num_scheduled_tokens=sum(scheduled.values()), token_budget=budget)
            if policy is not None and not policy.can_admit(r, state):
                break
            self.waiting.pop(0)
            r.status = RequestStatus.RUNNING
            r.block_ids = [self.free_block_ids.pop() for _ in range(needed)]
            self.running.append(r)
            scheduled[r.request_id] = n
            budget -= n
            new_reqs.append(NewRequestData(
                r.request_id, r.req.prompt_token_ids, r.req.sampling_params,
                tuple(r.block_ids), num_computed_tokens=0,
                output_token_ids=tuple(r.output_token_ids)))
        return new_reqs

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs = []
        rows = zip(runner_output.req_ids, runner_output.sampled_token_ids, strict=True)
        for row, (req_id, token_ids) in enumerate(rows):
            r = self.requests.get(req_id)
            if r is None or r.status != RequestStatus.RUNNING:
                continue  # finished or preempted meanwhile
            r.num_computed_tokens += scheduler_output.num_scheduled_tokens[req_id]
            status, stop_reason, new_ids = RequestStatus.RUNNING, None, []
            for token in token_ids:  # empty while a prompt is prefilled in chunks
                r.output_token_ids.append(token)
                new_ids.append(token)
                status, stop_reason = self._check_stop(r, token)
                if status.is_finished:
                    self._finish(r, status)
                    break
            prompt_logprobs = runner_output.prompt_logprobs.get(req_id)
            if new_ids or prompt_logprobs is not None:
                outputs.append(EngineCoreOutput(
                    req_id, tuple(new_ids), new_logprobs=_row(runner_output.logprobs, row),
                    new_prompt_logprobs=prompt_logprobs, finish_reason=status.finish_reason,
                    stop_reason=stop_reason))
        return outputs

    def _check_stop(self, r: _Request, token: int) -> tuple[RequestStatus, int | None]:
        params = r.req.sampling_params
        if len(r.output_token_ids) > params.min_tokens:  # EOS and stop ids wait for it
            if token == r.req.eos_token_id and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED, None
            if token in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token
        if (len(r.output_token_ids) == params.max_tokens
                or r.num_tokens >= self.ctx.max_model_len):
            return RequestStatus.FINISHED_LENGTH_CAPPED, None
        return RequestStatus.RUNNING, None

    # -- state ----------------------------------------------------------------------------

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def has_finished_requests(self) -> bool:
        return bool(self.finished_req_ids)

    def reset_prefix_cache(self) -> bool:
        return True  # no prefix cache: nothing to drop

    def make_stats(self) -> SchedulerStats:
        free, total = len(self.free_block_ids), self.ctx.num_kv_blocks
        preempted, self.num_preempted = self.num_preempted, 0
        return SchedulerStats(num_running_reqs=len(self.running),
                              num_waiting_reqs=len(self.waiting),
                              kv_cache_usage=1 - free / total, num_free_blocks=free,
                              num_total_blocks=total, num_preempted_reqs=preempted)


def _row(logprobs: SampleLogprobs | None, row: int) -> SampleLogprobs | None:
    """Row ``row`` of a step's sample logprobs; None when its request asked for none."""
    if logprobs is None or not logprobs.token_ids[row]:
        return None
    return SampleLogprobs((logprobs.token_ids[row],), (logprobs.logprobs[row],),
                          (logprobs.sampled_token_ranks[row],))
