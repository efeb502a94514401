"""Conversions between the SDK's data contracts and the messages of ``engine_core.proto``.

Each ``*_to_proto`` has an inverse ``*_from_proto``; a round trip gives an equal object,
with two documented exceptions that follow from the wire format:

* logprobs travel as float32, so a logprob comes back rounded to float32 (the sampler
  computes them in float32, so values that came from the engine come back unchanged);
* ``extra_args`` travels as JSON, so tuples come back as lists (and only JSON-serialisable
  values may be sent; anything else is a ``ValidationError`` naming ``extra_args``).

Token ids are packed little-endian int32 ``bytes``; ids outside the int32 range are an
``OverflowError``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Sequence
from typing import cast

from engine.core.messages import EngineInfo, StepOutputs
from engine.core.rpc._gen import engine_core_pb2 as pb
from engine.sdk.errors import PluginFailure, ValidationError
from engine.sdk.sampling_params import SamplingParams
from engine.sdk.scheduler import EngineCoreOutput, EngineRequest, RequestStatus, SampleLogprobs
from engine.sdk.stats import PrefixCacheStats, SchedulerStats

__all__ = [
    "pack_int32", "unpack_int32", "pack_float32", "unpack_float32",
    "sampling_params_to_proto", "sampling_params_from_proto",
    "request_to_proto", "request_from_proto",
    "request_status_to_proto", "request_status_from_proto",
    "logprobs_to_proto", "logprobs_from_proto",
    "output_to_proto", "output_from_proto",
    "stats_to_proto", "stats_from_proto",
    "step_outputs_to_proto", "step_outputs_from_proto",
    "info_to_proto", "info_from_proto",
]


# --- packed scalars ---------------------------------------------------------------------

def pack_int32(values: Iterable[int]) -> bytes:
    """Little-endian int32 bytes (4 per value).

    Raises:
        OverflowError: a value outside the int32 range.
    """
    items = values if isinstance(values, (tuple, list)) else tuple(values)
    try:
        return struct.pack(f"<{len(items)}i", *items)
    except struct.error as exc:
        raise OverflowError(f"token ids travel as int32: {exc}") from None


def unpack_int32(data: bytes) -> tuple[int, ...]:
    """The inverse of :func:`pack_int32`."""
    return struct.unpack(f"<{len(data) >> 2}i", data)


def pack_float32(values: Iterable[float]) -> bytes:
    """Little-endian float32 bytes (4 per value)."""
    items = values if isinstance(values, (tuple, list)) else tuple(values)
    return struct.pack(f"<{len(items)}f", *items)


def unpack_float32(data: bytes) -> tuple[float, ...]:
    """The inverse of :func:`pack_float32` (values widened to Python floats)."""
    return struct.unpack(f"<{len(data) >> 2}f", data)


# --- requests ---------------------------------------------------------------------------

def sampling_params_to_proto(params: SamplingParams) -> pb.SamplingParams:
    """Every field written; ``None`` fields left absent.

    Raises:
        ValidationError: ``extra_args`` is not JSON-serialisable.
    """
    msg = pb.SamplingParams(
        n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        min_p=params.min_p, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty, seed=params.seed,
        max_tokens=params.max_tokens, min_tokens=params.min_tokens, stop=params.stop,
        stop_token_ids=pack_int32(params.stop_token_ids), ignore_eos=params.ignore_eos,
        logprobs=params.logprobs, prompt_logprobs=params.prompt_logprobs,
        skip_special_tokens=params.skip_special_tokens,
        include_stop_str_in_output=params.include_stop_str_in_output,
    )
    if params.logit_bias is not None:
        msg.logit_bias.token_ids = pack_int32(params.logit_bias.keys())
        msg.logit_bias.biases.extend(params.logit_bias.values())
    if params.extra_args is not None:
        try:
            msg.extra_args_json = json.dumps(dict(params.extra_args), separators=(",", ":"))
        except (TypeError, ValueError) as exc:
            raise ValidationError(f"extra_args must be JSON-serialisable to reach EngineCore: "
                                  f"{exc}", param="extra_args") from exc
    if params.structured_outputs is not None:
        msg.structured_outputs_json = json.dumps(params.structured_outputs.to_dict(),
                                                 ensure_ascii=False, separators=(",", ":"))
    return msg


def sampling_params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """The inverse of :func:`sampling_params_to_proto` (validated again on construction)."""
    logit_bias = None
    if msg.HasField("logit_bias"):
        logit_bias = dict(zip(unpack_int32(msg.logit_bias.token_ids), msg.logit_bias.biases,
                              strict=True))
    extra_args = json.loads(msg.extra_args_json) if msg.HasField("extra_args_json") else None
    structured = (json.loads(msg.structured_outputs_json)
                  if msg.HasField("structured_outputs_json") else None)
    return SamplingParams(
        n=msg.n, temperature=msg.temperature, top_p=msg.top_p, top_k=msg.top_k,
        min_p=msg.min_p, presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty, repetition_penalty=msg.repetition_penalty,
        seed=msg.seed if msg.HasField("seed") else None,
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else None,
        min_tokens=msg.min_tokens, stop=tuple(msg.stop),
        stop_token_ids=unpack_int32(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        logit_bias=logit_bias, skip_special_tokens=msg.skip_special_tokens,
        include_stop_str_in_output=msg.include_stop_str_in_output, extra_args=extra_args,
        structured_outputs=structured,
    )


def request_to_proto(request: EngineRequest) -> pb.EngineRequest:
    """An ``EngineRequest`` as sent on the stream."""
    return pb.EngineRequest(
        request_id=request.request_id, prompt_token_ids=pack_int32(request.prompt_token_ids),
        sampling_params=sampling_params_to_proto(request.sampling_params),
        eos_token_id=request.eos_token_id, arrival_time=request.arrival_time,
        priority=request.priority,
    )


def request_from_proto(msg: pb.EngineRequest) -> EngineRequest:
    """The inverse of :func:`request_to_proto`."""
    return EngineRequest(
        request_id=msg.request_id, prompt_token_ids=unpack_int32(msg.prompt_token_ids),
        sampling_params=sampling_params_from_proto(msg.sampling_params),
        eos_token_id=msg.eos_token_id if msg.HasField("eos_token_id") else None,
        arrival_time=msg.arrival_time, priority=msg.priority,
    )


def request_status_to_proto(status: RequestStatus) -> pb.RequestStatus:
    """``RequestStatus.FINISHED_STOPPED`` -> ``REQUEST_STATUS_FINISHED_STOPPED``."""
    return cast(pb.RequestStatus, pb.RequestStatus.Value(f"REQUEST_STATUS_{status.name}"))


def request_status_from_proto(value: int) -> RequestStatus:
    """The inverse of :func:`request_status_to_proto`.

    Raises:
        ValueError: ``REQUEST_STATUS_UNSPECIFIED`` or an unknown value.
    """
    name = pb.RequestStatus.Name(value).removeprefix("REQUEST_STATUS_")
    if name not in RequestStatus.__members__:
        raise ValueError(f"request status {name} is not a RequestStatus")
    return RequestStatus[name]


# --- outputs ----------------------------------------------------------------------------

def logprobs_to_proto(logprobs: SampleLogprobs) -> pb.SampleLogprobs:
    """Rows concatenated into packed columns, with the row lengths alongside."""
    return pb.SampleLogprobs(
        token_ids=pack_int32(t for row in logprobs.token_ids for t in row),
        logprobs=pack_float32(v for row in logprobs.logprobs for v in row),
        row_lengths=pack_int32(len(row) for row in logprobs.token_ids),
        sampled_token_ranks=pack_int32(logprobs.sampled_token_ranks),
    )


def logprobs_from_proto(msg: pb.SampleLogprobs) -> SampleLogprobs:
    """The inverse of :func:`logprobs_to_proto` (logprobs rounded to float32)."""
    token_ids, values = unpack_int32(msg.token_ids), unpack_float32(msg.logprobs)
    if len(token_ids) != len(values):
        raise ValueError(f"SampleLogprobs has {len(token_ids)} token ids but {len(values)} "
                         f"logprobs")
    id_rows: list[tuple[int, ...]] = []
    value_rows: list[tuple[float, ...]] = []
    start = 0
    for length in unpack_int32(msg.row_lengths):
        id_rows.append(token_ids[start:start + length])
        value_rows.append(values[start:start + length])
        start += length
    if start != len(token_ids):
        raise ValueError(f"SampleLogprobs row lengths add up to {start}, not "
                         f"{len(token_ids)}")
    return SampleLogprobs(token_ids=tuple(id_rows), logprobs=tuple(value_rows),
                          sampled_token_ranks=unpack_int32(msg.sampled_token_ranks))


def output_to_proto(output: EngineCoreOutput, into: pb.EngineCoreOutput) -> None:
    """Write ``output`` into ``into`` (a new element of a repeated field)."""
    into.request_id = output.request_id
    into.new_token_ids = pack_int32(output.new_token_ids)
    into.num_cached_tokens = output.num_cached_tokens
    if output.new_logprobs is not None:
        into.new_logprobs.CopyFrom(logprobs_to_proto(output.new_logprobs))
    if output.new_prompt_logprobs is not None:
        into.new_prompt_logprobs.CopyFrom(logprobs_to_proto(output.new_prompt_logprobs))
    if output.finish_reason is not None:
        into.finish_reason = output.finish_reason
    if output.stop_reason is not None:
        into.stop_reason = output.stop_reason
    if output.error is not None:
        failure_to_proto(output.error, into.error)


def failure_to_proto(failure: PluginFailure, into: pb.PluginFailure) -> None:
    """Write ``failure`` into ``into``."""
    into.cause = failure.cause
    for name in ("plugin", "group", "distribution", "version"):
        value = getattr(failure, name)
        if value is not None:
            setattr(into, name, value)


def failure_from_proto(msg: pb.PluginFailure) -> PluginFailure:
    """The inverse of :func:`failure_to_proto`."""
    fields = {name: getattr(msg, name) if msg.HasField(name) else None
              for name in ("plugin", "group", "distribution", "version")}
    return PluginFailure(msg.cause, **fields)


def output_from_proto(msg: pb.EngineCoreOutput) -> EngineCoreOutput:
    """The inverse of :func:`output_to_proto`."""
    return EngineCoreOutput(
        request_id=msg.request_id, new_token_ids=unpack_int32(msg.new_token_ids),
        new_logprobs=(logprobs_from_proto(msg.new_logprobs)
                      if msg.HasField("new_logprobs") else None),
        new_prompt_logprobs=(logprobs_from_proto(msg.new_prompt_logprobs)
                             if msg.HasField("new_prompt_logprobs") else None),
        finish_reason=msg.finish_reason if msg.HasField("finish_reason") else None,
        stop_reason=msg.stop_reason if msg.HasField("stop_reason") else None,
        num_cached_tokens=msg.num_cached_tokens,
        error=failure_from_proto(msg.error) if msg.HasField("error") else None,
    )


def stats_to_proto(stats: SchedulerStats, into: pb.SchedulerStats | None = None
                   ) -> pb.SchedulerStats:
    """``SchedulerStats`` (written into ``into`` when given); returns the message."""
    msg = pb.SchedulerStats() if into is None else into
    msg.num_running_reqs = stats.num_running_reqs
    msg.num_waiting_reqs = stats.num_waiting_reqs
    msg.kv_cache_usage = stats.kv_cache_usage
    msg.num_free_blocks = stats.num_free_blocks
    msg.num_total_blocks = stats.num_total_blocks
    msg.num_preempted_reqs = stats.num_preempted_reqs
    _prefix_cache_to_proto(stats.prefix_cache, msg.prefix_cache)
    if stats.connector_prefix_cache is not None:
        _prefix_cache_to_proto(stats.connector_prefix_cache, msg.connector_prefix_cache)
    return msg


def _prefix_cache_to_proto(stats: PrefixCacheStats, msg: pb.PrefixCacheStats) -> None:
    msg.queries = stats.queries
    msg.hits = stats.hits
    msg.reset = stats.reset


def _prefix_cache_from_proto(msg: pb.PrefixCacheStats) -> PrefixCacheStats:
    return PrefixCacheStats(queries=msg.queries, hits=msg.hits, reset=msg.reset)


def stats_from_proto(msg: pb.SchedulerStats) -> SchedulerStats:
    """The inverse of :func:`stats_to_proto`."""
    return SchedulerStats(
        num_running_reqs=msg.num_running_reqs, num_waiting_reqs=msg.num_waiting_reqs,
        kv_cache_usage=msg.kv_cache_usage, num_free_blocks=msg.num_free_blocks,
        num_total_blocks=msg.num_total_blocks,
        prefix_cache=_prefix_cache_from_proto(msg.prefix_cache),
        num_preempted_reqs=msg.num_preempted_reqs,
        connector_prefix_cache=(_prefix_cache_from_proto(msg.connector_prefix_cache)
                                if msg.HasField("connector_prefix_cache") else None),
    )


def step_outputs_to_proto(outputs: Sequence[EngineCoreOutput],
                          stats: SchedulerStats | None, timestamp: float) -> pb.StepOutputs:
    """One step's outputs as one message."""
    msg = pb.StepOutputs(timestamp=timestamp)
    for output in outputs:
        output_to_proto(output, msg.outputs.add())
    if stats is not None:
        stats_to_proto(stats, msg.scheduler_stats)
    return msg


def step_outputs_from_proto(msg: pb.StepOutputs) -> StepOutputs:
    """The inverse of :func:`step_outputs_to_proto`."""
    return StepOutputs(
        outputs=[output_from_proto(o) for o in msg.outputs],
        scheduler_stats=(stats_from_proto(msg.scheduler_stats)
                         if msg.HasField("scheduler_stats") else None),
        timestamp=msg.timestamp,
    )


def info_to_proto(info: EngineInfo) -> pb.EngineInfo:
    """``EngineInfo`` as ``GetInfo`` returns it."""
    return pb.EngineInfo(model_name=info.model_name, max_model_len=info.max_model_len,
                         num_kv_blocks=info.num_kv_blocks, block_size=info.block_size,
                         vocab_size=info.vocab_size,
                         tensor_parallel_size=info.tensor_parallel_size,
                         executor_backend=info.executor_backend,
                         extra_args_keys=[pb.ExtraArgsKey(key=key, plugins=plugins)
                                          for key, plugins in info.extra_args_keys.items()])


def info_from_proto(msg: pb.EngineInfo) -> EngineInfo:
    """The inverse of :func:`info_to_proto`."""
    return EngineInfo(model_name=msg.model_name, max_model_len=msg.max_model_len,
                      num_kv_blocks=msg.num_kv_blocks, block_size=msg.block_size,
                      vocab_size=msg.vocab_size,
                      tensor_parallel_size=msg.tensor_parallel_size or 1,
                      executor_backend=msg.executor_backend or "uni",
                      extra_args_keys={item.key: tuple(item.plugins)
                                       for item in msg.extra_args_keys})

