"""Conversions between the SDK's per-step contracts and the messages of ``worker.proto``.

EngineCore encodes one :class:`~engine.sdk.scheduler.SchedulerOutput` per step and sends the
same bytes to every rank; each rank answers with a
:class:`~engine.sdk.scheduler.ModelRunnerOutput` or a ``WorkerError``. Each ``*_to_proto``
has an inverse ``*_from_proto`` and a round trip gives an equal object (tuples stay tuples,
frozensets stay frozensets, ``None`` stays ``None`` and ``b""`` stays ``b""``), with one
exception that follows from the wire format: logprobs travel as float32 (as in
``engine_core.proto``; the sampler computes them in float32, so they come back unchanged).

Ragged rows (block ids per cached request, sampled tokens per request) travel as one packed
int32 column plus packed row lengths; the row lengths are left out in the usual decode
step (no request got a new block; every request sampled exactly one token)::

    cached req_ids       ["a", "b", "c"]
    new_block_ids        [(), (7,), ()]   ->  new_block_ids = [7], new_block_id_counts = [0, 1, 0]
                         [(), (), ()]     ->  both columns empty
    num_scheduled_tokens {"a": 1, "b": 1, "c": 1, "n": 9}  (cached ids, then new ids)
                         -> [1, 1, 1, 9] and no id column; any other key order travels
                            with its own ``num_scheduled_req_ids``

This module also holds the errors of the worker boundary, used by both sides.
"""

from __future__ import annotations

import traceback as traceback_module
from collections.abc import Mapping, Sequence
from itertools import chain

import numpy as np

from engine.core.rpc._gen import worker_pb2 as pb
from engine.core.rpc.convert import (
    failure_from_proto,
    failure_to_proto,
    logprobs_from_proto,
    logprobs_to_proto,
    pack_int32,
    sampling_params_from_proto,
    sampling_params_to_proto,
    unpack_int32,
)
from engine.sdk.scheduler import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SampleLogprobs,
    SchedulerOutput,
)
from engine.sdk.structured_output import GrammarBitmask

__all__ = [
    "WorkerRpcError", "WorkerCallError", "WorkerUnavailableError",
    "scheduler_output_to_proto", "scheduler_output_from_proto",
    "runner_output_to_proto", "runner_output_from_proto",
    "worker_error_to_proto", "worker_error_from_proto",
]

#: The exception attributes a ``WorkerError`` copies (``engine.sdk.errors.PluginError``'s).
PLUGIN_ATTRIBUTES = ("plugin", "group", "distribution", "version")


# --- errors -----------------------------------------------------------------------------

class WorkerRpcError(RuntimeError):
    """A call to a worker failed: the base of the errors below.

    Attributes:
        rank: The worker's rank, when known.
        code: The gRPC status name (``"DEADLINE_EXCEEDED"``, ``"UNAUTHENTICATED"``, ...) when
            the call failed in gRPC; None when the worker itself raised.
    """

    def __init__(self, message: str, *, rank: int | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.code = code


class WorkerCallError(WorkerRpcError):
    """The worker raised while serving the call (its model, a plugin, a worker extension).

    ``str()`` is ``worker rank N: <type>: <message>``, followed by ``(plugin X of
    distribution D V)`` when the exception came from a plugin.

    Attributes:
        type: The exception's class name on the worker, e.g. ``"PluginError"``.
        message: ``str()`` of that exception.
        plugin, group, distribution, version: Copied from the exception when it had them
            (as ``engine.sdk.errors.PluginError`` does), else None.
        rank: The worker's rank.
        traceback: The traceback as the worker formatted it.
    """

    def __init__(self, *, type: str, message: str, rank: int, traceback: str = "",
                 plugin: str | None = None, group: str | None = None,
                 distribution: str | None = None, version: str | None = None) -> None:
        self.type, self.message, self.traceback = type, message, traceback
        self.plugin, self.group = plugin, group
        self.distribution, self.version = distribution, version
        super().__init__(self._format(rank), rank=rank)

    def _format(self, rank: int) -> str:
        text = f"worker rank {rank}: {self.type}: {self.message}"
        if self.plugin is None:
            return text
        if self.distribution is None:
            return f"{text} (plugin {self.plugin}, not from an installed distribution)"
        dist = self.distribution if self.version is None else \
            f"{self.distribution} {self.version}"
        return f"{text} (plugin {self.plugin} of distribution {dist})"


class WorkerUnavailableError(WorkerRpcError):
    """The worker could not be reached: its process died, or never listened.

    Attributes:
        address: Where the worker was to be reached.
    """

    def __init__(self, message: str, *, rank: int | None = None,
                 address: str | None = None) -> None:
        super().__init__(message, rank=rank, code="UNAVAILABLE")
        self.address = address


def worker_error_to_proto(exc: BaseException, rank: int) -> pb.WorkerError:
    """``exc`` raised on worker ``rank``, with its traceback and plugin attributes."""
    msg = pb.WorkerError(
        type=type(exc).__qualname__, message=str(exc), rank=rank,
        traceback="".join(traceback_module.format_exception(type(exc), exc,
                                                            exc.__traceback__)),
    )
    for name in PLUGIN_ATTRIBUTES:
        value = getattr(exc, name, None)
        if value is not None:
            setattr(msg, name, str(value))
    return msg


def worker_error_from_proto(msg: pb.WorkerError) -> WorkerCallError:
    """The error to raise in EngineCore for a ``WorkerError``."""
    fields = {name: getattr(msg, name) if msg.HasField(name) else None
              for name in PLUGIN_ATTRIBUTES}
    return WorkerCallError(type=msg.type, message=msg.message, rank=msg.rank,
                           traceback=msg.traceback, **fields)


# --- ragged rows ------------------------------------------------------------------------

def _split_rows(flat: tuple[int, ...], lengths: Sequence[int], what: str
                ) -> tuple[tuple[int, ...], ...]:
    rows = []
    start = 0
    for length in lengths:
        rows.append(flat[start:start + length])
        start += length
    if start != len(flat):
        raise ValueError(f"{what}: row lengths add up to {start}, not {len(flat)}")
    return tuple(rows)


# --- SchedulerOutput --------------------------------------------------------------------

def _new_request_to_proto(new: NewRequestData, into: pb.NewRequestData) -> None:
    into.req_id = new.req_id
    into.prompt_token_ids = pack_int32(new.prompt_token_ids)
    into.sampling_params.CopyFrom(sampling_params_to_proto(new.sampling_params))
    into.block_ids = pack_int32(new.block_ids)
    into.num_computed_tokens = new.num_computed_tokens
    into.output_token_ids = pack_int32(new.output_token_ids)


def _new_request_from_proto(msg: pb.NewRequestData) -> NewRequestData:
    return NewRequestData(
        req_id=msg.req_id, prompt_token_ids=unpack_int32(msg.prompt_token_ids),
        sampling_params=sampling_params_from_proto(msg.sampling_params),
        block_ids=unpack_int32(msg.block_ids), num_computed_tokens=msg.num_computed_tokens,
        output_token_ids=unpack_int32(msg.output_token_ids),
    )


def _cached_to_proto(cached: CachedRequestData, into: pb.CachedRequestData) -> None:
    into.req_ids.extend(cached.req_ids)
    rows = cached.new_block_ids
    if any(rows):
        into.new_block_ids = pack_int32(list(chain.from_iterable(rows)))
        into.new_block_id_counts = pack_int32([len(row) for row in rows])
    into.num_computed_tokens = pack_int32(cached.num_computed_tokens)


def _cached_from_proto(msg: pb.CachedRequestData) -> CachedRequestData:
    req_ids = tuple(msg.req_ids)
    counts = unpack_int32(msg.new_block_id_counts)
    if counts:
        rows = _split_rows(unpack_int32(msg.new_block_ids), counts, "new_block_ids")
    elif msg.new_block_ids:
        raise ValueError("CachedRequestData has new_block_ids but no new_block_id_counts")
    else:
        rows = ((),) * len(req_ids)
    return CachedRequestData(req_ids=req_ids, new_block_ids=rows,
                             num_computed_tokens=unpack_int32(msg.num_computed_tokens))


def scheduler_output_to_proto(out: SchedulerOutput, into: pb.SchedulerOutput | None = None
                              ) -> pb.SchedulerOutput:
    """One step's ``SchedulerOutput`` (written into ``into`` when given).

    Raises:
        OverflowError: an id or count outside the int32 range.
        ValidationError: a new request's ``extra_args`` is not JSON-serialisable.
    """
    msg = pb.SchedulerOutput() if into is None else into
    for new in out.scheduled_new_reqs:
        _new_request_to_proto(new, msg.scheduled_new_reqs.add())
    cached = out.scheduled_cached_reqs
    _cached_to_proto(cached, msg.scheduled_cached_reqs)
    counts = out.num_scheduled_tokens
    keys = list(counts)
    if keys != [*cached.req_ids, *(new.req_id for new in out.scheduled_new_reqs)]:
        msg.num_scheduled_req_ids.SetInParent()
        msg.num_scheduled_req_ids.ids.extend(keys)
    msg.num_scheduled_tokens = pack_int32(list(counts.values()))
    msg.total_num_scheduled_tokens = out.total_num_scheduled_tokens
    msg.finished_req_ids.extend(out.finished_req_ids)
    msg.preempted_req_ids.extend(out.preempted_req_ids)
    if out.kv_connector_metadata is not None:
        msg.kv_connector_metadata = out.kv_connector_metadata
    if out.grammar_bitmask is not None:
        grammar = out.grammar_bitmask
        bitmask = grammar.bitmask
        msg.grammar_bitmask.req_ids.extend(grammar.req_ids)
        msg.grammar_bitmask.words = int(bitmask.shape[1])
        msg.grammar_bitmask.bitmask = bitmask.contiguous().numpy().astype("<i4").tobytes()
    return msg


def scheduler_output_from_proto(msg: pb.SchedulerOutput) -> SchedulerOutput:
    """The inverse of :func:`scheduler_output_to_proto`.

    Raises:
        ValueError: the columns disagree in length.
    """
    new_reqs = tuple(_new_request_from_proto(item) for item in msg.scheduled_new_reqs)
    cached = _cached_from_proto(msg.scheduled_cached_reqs)
    if msg.HasField("num_scheduled_req_ids"):
        ids: Sequence[str] = msg.num_scheduled_req_ids.ids
    else:
        ids = [*cached.req_ids, *(new.req_id for new in new_reqs)]
    counts = unpack_int32(msg.num_scheduled_tokens)
    if len(ids) != len(counts):
        raise ValueError(f"SchedulerOutput has {len(counts)} num_scheduled_tokens for "
                         f"{len(ids)} request ids")
    return SchedulerOutput(
        scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached,
        num_scheduled_tokens=dict(zip(ids, counts, strict=True)),
        total_num_scheduled_tokens=msg.total_num_scheduled_tokens,
        finished_req_ids=frozenset(msg.finished_req_ids),
        preempted_req_ids=frozenset(msg.preempted_req_ids),
        kv_connector_metadata=(msg.kv_connector_metadata
                               if msg.HasField("kv_connector_metadata") else None),
        grammar_bitmask=(_grammar_bitmask(msg.grammar_bitmask)
                         if msg.HasField("grammar_bitmask") else None),
    )


def _grammar_bitmask(msg: pb.GrammarBitmask) -> GrammarBitmask:
    import torch

    rows = np.frombuffer(msg.bitmask, dtype="<i4").reshape(len(msg.req_ids), msg.words)
    return GrammarBitmask(tuple(msg.req_ids), torch.from_numpy(rows.astype(np.int32)))


# --- ModelRunnerOutput ------------------------------------------------------------------

def runner_output_to_proto(out: ModelRunnerOutput, into: pb.ModelRunnerOutput | None = None
                           ) -> pb.ModelRunnerOutput:
    """A rank's ``ModelRunnerOutput`` (written into ``into`` when given)."""
    msg = pb.ModelRunnerOutput() if into is None else into
    msg.req_ids.extend(out.req_ids)
    rows = out.sampled_token_ids
    if all(len(row) == 1 for row in rows):
        msg.sampled_token_ids = pack_int32([row[0] for row in rows])
    else:
        msg.sampled_token_ids = pack_int32(list(chain.from_iterable(rows)))
        msg.sampled_token_counts = pack_int32([len(row) for row in rows])
    if out.logprobs is not None:
        msg.logprobs.CopyFrom(logprobs_to_proto(out.logprobs))
    for req_id, logprobs in out.prompt_logprobs.items():
        item = msg.prompt_logprobs.add(req_id=req_id)
        item.logprobs.CopyFrom(logprobs_to_proto(logprobs))
    msg.finished_sending.extend(out.finished_sending)
    msg.finished_recving.extend(out.finished_recving)
    for req_id, failure in out.failed.items():
        failure_to_proto(failure, msg.failed[req_id])
    return msg


def runner_output_from_proto(msg: pb.ModelRunnerOutput) -> ModelRunnerOutput:
    """The inverse of :func:`runner_output_to_proto` (logprobs rounded to float32)."""
    tokens = unpack_int32(msg.sampled_token_ids)
    counts = unpack_int32(msg.sampled_token_counts)
    rows = (_split_rows(tokens, counts, "sampled_token_ids") if counts
            else tuple((token,) for token in tokens))
    prompt_logprobs: Mapping[str, SampleLogprobs] = {
        item.req_id: logprobs_from_proto(item.logprobs) for item in msg.prompt_logprobs}
    return ModelRunnerOutput(
        req_ids=tuple(msg.req_ids), sampled_token_ids=rows,
        logprobs=logprobs_from_proto(msg.logprobs) if msg.HasField("logprobs") else None,
        prompt_logprobs=prompt_logprobs,
        finished_sending=frozenset(msg.finished_sending),
        finished_recving=frozenset(msg.finished_recving),
        failed={req_id: failure_from_proto(item) for req_id, item in msg.failed.items()},
    )
