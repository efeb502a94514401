"""The default scheduler's step being built, its ``SchedulerOutput``, and per-request outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.kv_cache import KVCacheBlock, KVCacheManager
from engine.core.scheduler.request import Request
from engine.sdk.scheduler import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    RequestStatus,
    SampleLogprobs,
    SchedulerOutput,
)


@dataclass
class Step:
    """The step being built by ``schedule()``."""

    token_budget: int
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_reqs: list[Request] = field(default_factory=list)
    # Running requests scheduled again, with the block ids appended for them this step.
    cached_reqs: dict[str, tuple[Request, tuple[int, ...]]] = field(default_factory=dict)
    preempted_req_ids: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class Lookup:
    """What a waiting request finds computed at admission."""

    hit_blocks: list[KVCacheBlock]
    num_local_tokens: int  # prefix-cache hits, or tokens an asynchronous load brought
    num_external_tokens: int = 0  # offered by the KV connector and taken
    load_async: bool = False
    asked_connector: bool = False


def build_output(step: Step, kv: KVCacheManager, finished_req_ids: frozenset[str],
                 max_num_batched_tokens: int) -> SchedulerOutput:
    """The ``SchedulerOutput`` of ``step``: new requests in full, the others as deltas."""
    new_reqs = tuple(
        NewRequestData(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            block_ids=tuple(kv.get_block_ids(request.request_id)),
            num_computed_tokens=request.num_computed_tokens,
            output_token_ids=tuple(request.output_token_ids),
        )
        for request in step.new_reqs
    )
    cached = step.cached_reqs.values()
    cached_reqs = CachedRequestData(
        req_ids=tuple(request.request_id for request, _ in cached),
        new_block_ids=tuple(block_ids for _, block_ids in cached),
        num_computed_tokens=tuple(request.num_computed_tokens for request, _ in cached),
    )
    return SchedulerOutput(
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=cached_reqs,
        num_scheduled_tokens=step.num_scheduled_tokens,
        total_num_scheduled_tokens=max_num_batched_tokens - step.token_budget,
        finished_req_ids=finished_req_ids,
        preempted_req_ids=frozenset(step.preempted_req_ids),
    )


def request_output(request: Request, row: int | None, runner_output: ModelRunnerOutput,
                   ) -> EngineCoreOutput | None:
    """Append ``request``'s sampled tokens (row ``row``); its output, or None if nothing new.

    Stops at the first token that finishes the request (its stop conditions, see
    ``engine.core.scheduler.request``).
    """
    new_token_ids: tuple[int, ...] = ()
    # A request still catching up (partial prefill chunk) samples nothing.
    if row is not None and request.num_computed_tokens >= request.num_tokens:
        sampled = runner_output.sampled_token_ids[row]
        for index, token_id in enumerate(sampled):
            if request.append_output_token(token_id):
                new_token_ids = sampled[: index + 1]
                break
        else:
            new_token_ids = sampled
    prompt_logprobs = runner_output.prompt_logprobs.get(request.request_id)
    finished = request.status is not RequestStatus.RUNNING
    if not new_token_ids and not finished and prompt_logprobs is None:
        return None
    new_logprobs = None
    logprobs = runner_output.logprobs
    if new_token_ids and logprobs is not None and request.sampling_params.logprobs is not None:
        new_logprobs = logprobs_row(logprobs, row)
    return EngineCoreOutput(
        request_id=request.request_id,
        new_token_ids=tuple(new_token_ids),
        new_logprobs=new_logprobs,
        new_prompt_logprobs=prompt_logprobs,
        finish_reason=request.status.finish_reason if finished else None,
        stop_reason=request.stop_reason,
        num_cached_tokens=request.num_cached_tokens,
    )


def logprobs_row(logprobs: SampleLogprobs, row: int | None) -> SampleLogprobs | None:
    """Row ``row`` of a step's logprobs, or None when that request has none."""
    if row is None or row >= len(logprobs.token_ids) or not logprobs.token_ids[row]:
        return None
    return SampleLogprobs(
        token_ids=(logprobs.token_ids[row],),
        logprobs=(logprobs.logprobs[row],),
        sampled_token_ranks=(logprobs.sampled_token_ranks[row],),
    )
