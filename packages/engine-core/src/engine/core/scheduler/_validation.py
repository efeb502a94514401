"""Checks of the scheduler's context and of incoming requests, with actionable messages."""

from __future__ import annotations

from engine.sdk.kv_connector import KVConnectorScheduler
from engine.sdk.scheduler import EngineRequest, SchedulerContext


def validate_context(ctx: SchedulerContext) -> None:
    """Reject a context the default scheduler cannot serve without hanging.

    Raises:
        ValueError: A size is not positive; the KV cache cannot hold one sequence of
            ``max_model_len`` tokens (it could never finish alone); chunked prefill is off
            and ``max_num_batched_tokens < max_model_len`` (a long sequence, e.g. one
            resumed after preemption, could never be scheduled); ``kv_connector`` is not a
            ``KVConnectorScheduler``.
    """
    for name in (
        "block_size",
        "num_kv_blocks",
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_model_len",
    ):
        value = getattr(ctx, name)
        if value < 1:
            raise ValueError(f"scheduler: {name} must be >= 1, got {value}")
    capacity = ctx.num_kv_blocks * ctx.block_size
    if capacity < ctx.max_model_len:
        raise ValueError(
            f"scheduler: the KV cache holds {capacity} tokens ({ctx.num_kv_blocks} blocks of "
            f"{ctx.block_size}), fewer than max_model_len={ctx.max_model_len}; lower "
            "max_model_len or give the KV cache more blocks"
        )
    if not ctx.enable_chunked_prefill and ctx.max_num_batched_tokens < ctx.max_model_len:
        raise ValueError(
            f"scheduler: with chunked prefill disabled, max_num_batched_tokens "
            f"({ctx.max_num_batched_tokens}) must be >= max_model_len ({ctx.max_model_len}), "
            "or a long sequence could never be scheduled; raise max_num_batched_tokens, "
            "lower max_model_len or enable chunked prefill"
        )
    if ctx.kv_connector is not None and not isinstance(ctx.kv_connector, KVConnectorScheduler):
        raise ValueError(
            f"scheduler: kv_connector must be the scheduler side of a KV connector (a "
            f"KVConnectorScheduler), got {type(ctx.kv_connector).__qualname__}"
        )


def validate_request(request: EngineRequest, max_model_len: int, is_duplicate: bool) -> None:
    """Reject a request the scheduler cannot serve.

    Raises:
        ValueError: The id is already known, the prompt is empty, or the prompt is longer
            than ``max_model_len``.
    """
    if is_duplicate:
        raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
    num_prompt_tokens = len(request.prompt_token_ids)
    if num_prompt_tokens == 0:
        raise ValueError(f"request {request.request_id!r} has an empty prompt")
    if num_prompt_tokens > max_model_len:
        raise ValueError(
            f"request {request.request_id!r}: prompt of {num_prompt_tokens} tokens is longer "
            f"than max_model_len={max_model_len}"
        )
