"""Scheduler plugin: a complete first-come-first-served ``SchedulerInterface``.

Block bookkeeping of its own over block ids ``1..num_kv_blocks`` (0 is the null block),
no prefix caching. Each step:

1. running requests, oldest first, get their remaining tokens (chunked by the token
   budget); when a block is missing, the newest running request is preempted (by
   recompute: its blocks are freed, it goes back to the front of the waiting queue and is
   later resent in full with its output so far);
2. then, if nothing was preempted, waiting requests are admitted in arrival order while
   the budget, ``max_num_seqs`` and free blocks allow (head-of-line: the first that does
   not fit stops admission).

It ignores the scheduling policy (it is FCFS by design) and supports no KV connector.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from engine.sdk import (
    CachedRequestData,
    EngineCoreOutput,
    EngineRequest,
    ModelRunnerOutput,
    NewRequestData,
    PrefixCacheStats,
    RequestStatus,
    SampleLogprobs,
    SamplingParams,
    SchedulerContext,
    SchedulerInterface,
    SchedulerOutput,
    SchedulerStats,
    ValidationError,
)
from engine_test_plugin_sdk1.counters import count


@dataclass(eq=False)
class _Request:
    """The scheduler's state of one request (satisfies ``engine.sdk.RequestView``)."""

    request: EngineRequest
    output_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_sent_blocks: int = 0  # blocks the workers know (for the per-step deltas)
    status: RequestStatus = RequestStatus.WAITING

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_token_ids(self) -> Sequence[int]:
        return self.request.prompt_token_ids

    @property
    def output_token_ids(self) -> Sequence[int]:
        return tuple(self.output_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_ids)

    @property
    def sampling_params(self) -> SamplingParams:
        return self.request.sampling_params

    @property
    def priority(self) -> int:
        return self.request.priority

    @property
    def arrival_time(self) -> float:
        return self.request.arrival_time


@dataclass
class _Step:
    """The step being built by ``schedule()``."""

    budget: int
    num_scheduled: dict[str, int] = field(default_factory=dict)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_ids: list[str] = field(default_factory=list)
    cached_new_blocks: list[tuple[int, ...]] = field(default_factory=list)
    cached_computed: list[int] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)


class Sdk1FCFSScheduler(SchedulerInterface):
    def __init__(self, ctx: SchedulerContext) -> None:
        super().__init__(ctx)
        if ctx.kv_connector is not None:
            raise ValidationError("the sdk1_fcfs scheduler does not support KV connectors; "
                                  "unset --kv-connector", param="scheduler")
        if ctx.num_kv_blocks * ctx.block_size < ctx.max_model_len:
            raise ValidationError(
                f"the sdk1_fcfs scheduler needs KV blocks for one sequence of max_model_len="
                f"{ctx.max_model_len} tokens; it has {ctx.num_kv_blocks} of {ctx.block_size}",
                param="num_kv_blocks")
        self.free_block_ids: deque[int] = deque(range(1, ctx.num_kv_blocks + 1))
        self.requests: dict[str, _Request] = {}  # every unfinished request
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []  # in admission order (oldest first)
        self.finished_req_ids: set[str] = set()  # to tell the workers in the next step
        self.num_preempted_since_stats = 0
        self.is_shut_down = False

    # -- requests ----------------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        count("sdk1_fcfs.add_request")
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} is already scheduled")
        if not request.prompt_token_ids:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        r = _Request(request)
        self.requests[request.request_id] = r
        self.waiting.append(r)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        count("sdk1_fcfs.finish_requests")
        for req_id in request_ids:
            r = self.requests.get(req_id)
            if r is not None:
                self._finish(r, status)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def has_finished_requests(self) -> bool:
        return bool(self.finished_req_ids)

    # -- one step ----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        count("sdk1_fcfs.schedule")
        step = _Step(budget=self.ctx.max_num_batched_tokens)
        self._schedule_running(step)
        if not step.preempted:
            self._admit_waiting(step)
        finished, self.finished_req_ids = frozenset(self.finished_req_ids), set()
        cached = CachedRequestData(req_ids=tuple(step.cached_ids),
                                   new_block_ids=tuple(step.cached_new_blocks),
                                   num_computed_tokens=tuple(step.cached_computed))
        return SchedulerOutput(
            scheduled_new_reqs=tuple(step.new_reqs), scheduled_cached_reqs=cached,
            num_scheduled_tokens=step.num_scheduled,
            total_num_scheduled_tokens=sum(step.num_scheduled.values()),
            finished_req_ids=finished, preempted_req_ids=frozenset(step.preempted))

    def _schedule_running(self, step: _Step) -> None:
        for r in list(self.running):
            if r.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if step.budget == 0:
                return
            num_tokens = min(r.num_tokens - r.num_computed_tokens, step.budget)
            if not self._allocate_or_preempt(r, r.num_computed_tokens + num_tokens, step):
                continue  # r itself was preempted
            step.num_scheduled[r.request_id] = num_tokens
            step.budget -= num_tokens
            step.cached_ids.append(r.request_id)
            step.cached_new_blocks.append(tuple(r.block_ids[r.num_sent_blocks:]))
            step.cached_computed.append(r.num_computed_tokens)
            r.num_sent_blocks = len(r.block_ids)

    def _allocate_or_preempt(self, r: _Request, num_tokens: int, step: _Step) -> bool:
        """Give ``r`` blocks for ``num_tokens``, preempting the newest requests if needed.

        Returns False when ``r`` itself had to be preempted.
        """
        need = self._blocks_for(num_tokens) - len(r.block_ids)
        while need > len(self.free_block_ids):
            victim = self.running[-1]
            self._preempt(victim, step)
            if victim is r:
                return False
        r.block_ids += [self.free_block_ids.popleft() for _ in range(need)]
        return True

    def _admit_waiting(self, step: _Step) -> None:
        ctx = self.ctx
        while self.waiting and len(self.running) < ctx.max_num_seqs and step.budget > 0:
            r = self.waiting[0]
            num_tokens = r.num_tokens  # nothing is cached: the whole sequence is computed
            if num_tokens > step.budget:
                fits_alone = num_tokens <= ctx.max_num_batched_tokens
                if not ctx.enable_chunked_prefill and fits_alone:
                    return  # wait for a step with room for the whole prompt
                num_tokens = step.budget
            need = self._blocks_for(num_tokens)
            if need > len(self.free_block_ids):
                return
            self.waiting.popleft()
            r.block_ids = [self.free_block_ids.popleft() for _ in range(need)]
            r.num_computed_tokens = 0
            r.num_sent_blocks = len(r.block_ids)
            r.status = RequestStatus.RUNNING
            self.running.append(r)
            step.num_scheduled[r.request_id] = num_tokens
            step.budget -= num_tokens
            step.new_reqs.append(NewRequestData(
                req_id=r.request_id, prompt_token_ids=tuple(r.request.prompt_token_ids),
                sampling_params=r.sampling_params, block_ids=tuple(r.block_ids),
                num_computed_tokens=0, output_token_ids=tuple(r.output_ids)))

    def _preempt(self, r: _Request, step: _Step) -> None:
        count("sdk1_fcfs.preempt")
        self.running.remove(r)
        self._free_blocks(r)
        r.num_computed_tokens = 0
        r.num_sent_blocks = 0
        r.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(r)  # older than everything waiting
        step.preempted.add(r.request_id)
        self.num_preempted_since_stats += 1

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.ctx.block_size)

    def _free_blocks(self, r: _Request) -> None:
        self.free_block_ids.extend(r.block_ids)
        r.block_ids = []

    # -- results -----------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        count("sdk1_fcfs.update_from_output")
        outputs: list[EngineCoreOutput] = []
        rows = zip(runner_output.req_ids, runner_output.sampled_token_ids, strict=True)
        for row, (req_id, token_ids) in enumerate(rows):
            r = self.requests.get(req_id)
            if r is None or r.status is not RequestStatus.RUNNING:
                continue  # finished or aborted while the step ran
            r.num_computed_tokens += scheduler_output.num_scheduled_tokens[req_id]
            status, stop_reason, new_ids = RequestStatus.RUNNING, None, []
            for token in token_ids:  # empty while a prompt is prefilled in chunks
                r.output_ids.append(token)
                new_ids.append(token)
                status, stop_reason = self._check_stop(r, token)
                if status.is_finished:
                    break
            prompt_logprobs = runner_output.prompt_logprobs.get(req_id)
            if new_ids or status.is_finished or prompt_logprobs is not None:
                outputs.append(EngineCoreOutput(
                    request_id=req_id, new_token_ids=tuple(new_ids),
                    new_logprobs=_logprobs_row(runner_output.logprobs, row, bool(new_ids)),
                    new_prompt_logprobs=prompt_logprobs,
                    finish_reason=status.finish_reason, stop_reason=stop_reason))
            if status.is_finished:
                self._finish(r, status)
        return outputs

    def _check_stop(self, r: _Request, token: int) -> tuple[RequestStatus, int | None]:
        params = r.sampling_params
        num_output = len(r.output_ids)
        if num_output >= params.min_tokens:
            if token == r.request.eos_token_id and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED, None
            if token in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token
        if params.max_tokens is not None and num_output >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED, None
        if r.num_tokens >= self.ctx.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED, None
        return RequestStatus.RUNNING, None

    def _finish(self, r: _Request, status: RequestStatus) -> None:
        if r in self.running:
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)
        self._free_blocks(r)
        r.status = status
        del self.requests[r.request_id]
        self.finished_req_ids.add(r.request_id)

    # -- the rest of the interface -----------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        return True  # no prefix cache: nothing to drop

    def make_stats(self) -> SchedulerStats:
        free, total = len(self.free_block_ids), self.ctx.num_kv_blocks
        preempted, self.num_preempted_since_stats = self.num_preempted_since_stats, 0
        return SchedulerStats(
            num_running_reqs=len(self.running), num_waiting_reqs=len(self.waiting),
            kv_cache_usage=(total - free) / total, num_free_blocks=free,
            num_total_blocks=total, prefix_cache=PrefixCacheStats(),
            num_preempted_reqs=preempted)

    def shutdown(self) -> None:
        count("sdk1_fcfs.shutdown")
        self.is_shut_down = True


def _logprobs_row(
    logprobs: SampleLogprobs | None, row: int, has_tokens: bool
) -> SampleLogprobs | None:
    """Row ``row`` of the step's logprobs, when the request asked for them."""
    if logprobs is None or not has_tokens or row >= len(logprobs.token_ids):
        return None
    if not logprobs.token_ids[row]:
        return None  # this request did not ask for logprobs
    return SampleLogprobs(token_ids=(logprobs.token_ids[row],),
                          logprobs=(logprobs.logprobs[row],),
                          sampled_token_ranks=(logprobs.sampled_token_ranks[row],))
