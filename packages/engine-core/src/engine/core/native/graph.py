"""Step graphs: a forward pass recorded once as native calls, replayed in C.

A decode step of the engine's CPU path is ~10 kernel calls per layer, each with a few
microseconds of Python around it (module calls, views, checks): ~4 ms a step for the
12-layer benchmark model, as much as its whole attention at batch 64 and 40% of a batch-1
step. A graph is CUDA graphs' idea on the CPU: ``record`` runs the forward pass with every
native call handed to a recorder instead of running (``engine.sdk.graph_calls``: the
engine's kernels' step-graph entries and any plugin's ``GraphFunction`` alike),
fixes every pointer (weights, KV caches, static inputs, and the pass's own buffers, laid out
in one arena by their lifetimes), and ``KernelGraph.run`` replays the calls in C
(``graph.cpp``) for any token count up to the one recorded: one ctypes call a step.

What makes a recording sound:

* Only graph functions run (C functions with the graph's ABI, ``graph_call.h``: each
  recorded with its address and arguments; graph.cpp names none); torch ops may only make views,
  allocate, copy (a ``clone``, ``copy_`` or copying ``reshape``/``contiguous``, recorded as
  ``copy_rows``) or look up an embedding (``gather_rows``), its rows then perhaps
  multiplied by a Python number (``scale_rows``: an embedding's output scale, Gemma's
  ``sqrt(hidden_size)``; only the rows of a lookup, so that any other product stays
  refused). Anything else that computes
  (a plugin's torch code, an op's reference path) makes ``record`` raise ``NotCapturable``
  with the op's name, and the caller runs the model eagerly.
* The pass is recorded at several token counts (``record_at``): the calls must be the same
  but for the arguments that are a fixed multiple of the token count (the count itself,
  or the rows of a per-head view: tokens * heads), which the replay sets, and every
  pointer into the pass's buffers must sit at the same offset. A call whose arguments
  depend on the count any other way (a last-row pointer, a branch on the count) is refused.
* A recording may go on past the pass's output with a second stage (``record(..., then=)``,
  the LM head after the layers): a run does the first stage alone or both, and the first
  stage's output stays valid after the second. A stage may end with a conversion of its
  rows to float32 (``compute_logits``' ``.float()``): the stage's output is then the rows
  before it, and the caller converts them.
* Python side effects of the forward pass are not replayed: the caller must allow only
  modules that say they have none (``engine.core.worker.step_graph`` asks every component
  of the pass: ``engine.core.worker.capture_components``).
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.core.native.runtime import GRAPH_OP_WIDTH, GraphRuntime
from engine.sdk import graph_calls
from engine.sdk.graph_calls import GraphFunction, GraphValue, Pointer, RecordingRefused

aten = torch.ops.aten

#: Ops that may copy when they cannot make a view: recorded as ``copy_rows`` when they do.
_MAYBE_COPIES = {aten.contiguous, aten.reshape, aten.flatten}
#: Conversions: a view or a copy when the dtype stays, else a stage output's conversion.
_CONVERSIONS = {aten.to, aten._to_copy}
#: Ops that only allocate (the contents are whatever the recorded kernels write).
_ALLOCATIONS = {aten.empty, aten.empty_like, aten.new_empty, aten.empty_strided}
#: Byte alignment of each buffer in the arena (a cache line; the arena starts on a page).
ALIGN = 64


#: The forward pass cannot be recorded; the message says what in it stopped it. The SDK's
#: exception, so a kernel's own code refuses a recording the way the recorder does.
NotCapturable = RecordingRefused


@dataclass(frozen=True)
class _Call:
    """A recorded call: the function (its name and address) and its arguments."""

    name: str
    address: int
    #: Pointers as a ``_Buffer`` (into the pass's buffers), an address or None; the rest
    #: integers or floats.
    values: list[Any]


@dataclass(frozen=True)
class _Buffer:
    """A pointer into a buffer the recorded pass allocated: its index and byte offset."""

    index: int
    offset: int


@dataclass
class _Recording:
    """One recorded pass: its calls, its buffers and what it returned."""

    rows: int
    ops: list[_Call] = field(default_factory=list)
    buffers: list[torch.Tensor] = field(default_factory=list)  # kept alive: no reuse
    starts: list[int] = field(default_factory=list)  # sorted by address, with ...
    by_start: list[int] = field(default_factory=list)  # ... their indices
    #: Per stage: where its output is (buffer, shape after the rows, strides, dtype) ...
    outputs: list[tuple[_Buffer, tuple[int, ...], tuple[int, ...], torch.dtype]] = field(
        default_factory=list)
    #: ... and how many calls the pass has made when that output is ready.
    stage_ends: list[int] = field(default_factory=list)
    #: Float32 conversions of the pass's rows, by the address of the result: their source.
    conversions: dict[int, torch.Tensor] = field(default_factory=dict)
    #: The embedding lookups' outputs (their addresses): rows a number may scale.
    lookups: set[int] = field(default_factory=set)

    def finish_stage(self, out: torch.Tensor) -> None:
        """``out`` is the output of the calls recorded so far (or their float32 conversion).

        Raises:
            NotCapturable: it is not ``[rows, ...]`` in the pass's own buffers.
        """
        source = self.conversions.get(out.data_ptr()) if out.numel() else None
        if source is not None and source.shape == out.shape:
            out = source  # the caller converts the rows (see the module docstring)
        buffer = self.buffer_of(out.data_ptr()) if out.numel() else None
        if buffer is None or out.dim() != 2 or out.shape[0] != self.rows:
            raise NotCapturable(f"a stage of the forward pass returned {tuple(out.shape)}, "
                                f"not [{self.rows}, features] rows of its own buffers")
        self.outputs.append((buffer, tuple(out.shape[1:]), tuple(out.stride()), out.dtype))
        self.stage_ends.append(len(self.ops))

    def allocated(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            return
        start = storage.data_ptr()
        at = bisect.bisect(self.starts, start)
        self.starts.insert(at, start)
        self.by_start.insert(at, len(self.buffers))
        self.buffers.append(tensor)

    def buffer_of(self, address: int) -> _Buffer | None:
        at = bisect.bisect(self.starts, address) - 1
        if at < 0:
            return None
        index = self.by_start[at]
        storage = self.buffers[index].untyped_storage()
        offset = address - storage.data_ptr()
        return _Buffer(index, offset) if offset < storage.nbytes() else None

    def sizes(self) -> list[int]:
        return [t.untyped_storage().nbytes() for t in self.buffers]


class _Recorder:
    """Takes the graph functions' calls for a recording (``engine.sdk.graph_calls``)."""

    def __init__(self, recording: _Recording, known: Sequence[tuple[int, int]]) -> None:
        self.recording = recording
        self.known = known  # (start, end) of the memory the graph may point at directly

    def record_call(self, function: GraphFunction, args: Sequence[GraphValue]) -> None:
        # GraphFunction has checked the arguments (at most GRAPH_MAX_ARGS, each typed).
        values = [self._pointer(function.name, value.address) if isinstance(value, Pointer)
                  else value for value in args]
        self.recording.ops.append(_Call(function.name, function.address, values))

    def _pointer(self, name: str, address: int) -> Any:
        if address == 0:
            return None
        buffer = self.recording.buffer_of(address)
        if buffer is not None:
            return buffer
        if any(start <= address < end for start, end in self.known):
            return address
        raise NotCapturable(f"{name} reads memory that is neither the model's, the KV "
                            f"cache's, the graph's inputs nor the pass's own buffers")


class _RecordingMode(TorchDispatchMode):
    """Lets through views and allocations, records copies and lookups, refuses the rest."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Nothing is compiled under this mode: without this, torch wraps the handler in
        # dynamo's disable, whose first call imports torch._dynamo (~0.8 s of start-up).
        return False

    def __init__(self, recording: _Recording, runtime: GraphRuntime) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.recording = recording
        self.runtime = runtime

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in _ALLOCATIONS:
            out = func(*args, **kwargs)
            self.recording.allocated(out)
            return out
        if packet is aten.clone:
            out = func(*args, **kwargs)
            return self._copied(args[0], out)
        if packet is aten.copy_:
            dst, src = args[0], args[1]
            if dst.shape != src.shape or dst.dtype != src.dtype:
                raise NotCapturable(f"the forward pass copies {tuple(src.shape)} {src.dtype} "
                                    f"into {tuple(dst.shape)} {dst.dtype} (a graph copies "
                                    f"like for like only)")
            out = func(*args, **kwargs)
            self.runtime.copy_rows(src, dst)
            return out
        if packet in _CONVERSIONS:
            return self._converted(args[0], func(*args, **kwargs))
        if packet is aten.embedding:
            weight, ids = args[0], args[1]
            out = func(*args, **kwargs)
            if ids.dim() != 1 or ids.dtype != torch.int64:
                raise NotCapturable(f"an embedding lookup of {ids.dim()}-D {ids.dtype} ids "
                                    f"(a graph looks up 1-D int64 ids)")
            self.recording.allocated(out)
            self.runtime.gather_rows(weight, ids, out)
            self.recording.lookups.add(out.data_ptr())
            return out
        if (packet in (aten.mul, aten.mul_) and _is_number(args[1])
                and args[0].data_ptr() in self.recording.lookups):
            return self._scaled(func, args, kwargs)
        if func.is_view or packet in _MAYBE_COPIES:
            out = func(*args, **kwargs)
            if packet in _MAYBE_COPIES and not _aliases(out, args[0]):
                return self._copied(args[0], out)
            return out
        raise NotCapturable(f"the forward pass runs the torch op {func} (a graph records "
                            f"native calls, views, copies and embedding lookups (scaled by a "
                            f"number or not) only)")

    def _converted(self, src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out = src.to(...)``: a view, a copy, or a stage output's float32 conversion."""
        if out.dtype == src.dtype and out.device == src.device:
            return out if _aliases(out, src) else self._copied(src, out)
        if (out.dtype != torch.float32 or out.shape != src.shape or src.dim() != 2
                or out.device != src.device
                or self.recording.buffer_of(src.data_ptr()) is None):
            raise NotCapturable(f"the forward pass converts {tuple(src.shape)} {src.dtype} to "
                                f"{out.dtype} (a graph converts only a stage's output rows, "
                                f"to float32)")
        self.recording.conversions[out.data_ptr()] = src  # nothing recorded: see finish_stage
        return out

    def _scaled(self, func: Any, args: Any, kwargs: Any) -> torch.Tensor:
        """``lookup * number`` (or ``lookup.mul_(number)``): recorded as ``scale_rows``."""
        src, factor = args[0], args[1]
        out: torch.Tensor = func(*args, **kwargs)
        if out.dtype != src.dtype or out.shape != src.shape or src.dim() == 0:
            raise NotCapturable(f"the forward pass multiplies an embedding lookup "
                                f"{tuple(src.shape)} {src.dtype} by {factor!r} (a graph scales "
                                f"float rows by a number keeping their dtype)")
        if out is not src:
            self.recording.allocated(out)
        try:
            self.runtime.scale_rows(src, float(factor), out)
        except ValueError as exc:
            raise NotCapturable(f"a scale of {tuple(src.shape)} {src.dtype} ({exc})") from None
        return out

    def _copied(self, src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        self.recording.allocated(out)
        try:
            self.runtime.copy_rows(src, out.view(src.shape))
        except (ValueError, RuntimeError) as exc:
            raise NotCapturable(f"a copy of {tuple(src.shape)} with strides {src.stride()} "
                                f"({exc})") from None
        return out


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _aliases(out: torch.Tensor, src: torch.Tensor) -> bool:
    return bool(out.untyped_storage().data_ptr() == src.untyped_storage().data_ptr())


@contextlib.contextmanager
def _recording_into(runtime: GraphRuntime, recording: _Recording,
                    known: Sequence[tuple[int, int]]) -> Iterator[None]:
    # Every graph function called here records: the engine's kernels (whichever instance
    # of the library a layer holds) and any plugin's.
    with graph_calls.recording(_Recorder(recording, known)), _RecordingMode(recording,
                                                                            runtime):
        yield


def record(runtime: GraphRuntime, forward: Callable[[int], torch.Tensor], rows: int,
           known: Sequence[torch.Tensor], *,
           then: Callable[[torch.Tensor], torch.Tensor] | None = None) -> _Recording:
    """One pass of ``forward(rows)`` with the kernels recorded (nothing is computed).

    ``known``: tensors whose memory the calls may point at as it is (parameters, KV
    caches, the graph's static inputs), kept alive by their owners. ``then``: a second
    stage, recorded on from ``forward``'s output (a run may stop before it).
    """
    recording = _Recording(rows)
    spans = [_span(t) for t in known if t.untyped_storage().nbytes()]
    with _recording_into(runtime, recording, spans):
        out = forward(rows)
        recording.finish_stage(out)
        if then is not None:
            recording.finish_stage(then(out))
    return recording


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


class KernelGraph:
    """Recorded kernel calls with fixed pointers, run for any token count up to ``rows``.

    Build one with ``KernelGraph.from_recordings``: the first recording (the most rows)
    sizes the buffers; the others must agree with it (see the module docstring).
    """

    def __init__(self, runtime: GraphRuntime, ops: torch.Tensor, names: list[str],
                 arena: torch.Tensor, outputs: list[torch.Tensor], stage_ends: list[int],
                 rows: int) -> None:
        self.runtime = runtime
        self.ops = ops
        self.names = names
        self.arena = arena
        #: Per stage, its output (``[rows, ...]`` views of the arena) and its last call + 1.
        self.outputs = outputs
        self.stage_ends = stage_ends
        #: The most tokens a run takes.
        self.rows = rows

    @property
    def num_ops(self) -> int:
        return len(self.names)

    @property
    def num_stages(self) -> int:
        return len(self.outputs)

    @property
    def arena_bytes(self) -> int:
        return int(self.arena.numel())

    @classmethod
    def from_recordings(cls, runtime: GraphRuntime,
                        recordings: Sequence[_Recording]) -> KernelGraph:
        first = recordings[0]
        masks = _row_masks(recordings)
        offsets, total = _plan(first)
        arena = torch.empty(total + 4096, dtype=torch.uint8)
        base = -arena.data_ptr() % 4096
        arena = arena[base: base + total]
        origin = arena.data_ptr()
        table = np.zeros((len(first.ops), GRAPH_OP_WIDTH), dtype=np.int64)
        for i, (call, (mask, multiples)) in enumerate(zip(first.ops, masks, strict=True)):
            table[i, 0] = call.address
            table[i, 1] = mask
            table[i, 2] = len(call.values)
            for j, value in enumerate(call.values):  # one in the mask holds its multiple
                table[i, 3 + j] = multiples.get(j) or _encode(value, origin, offsets)
        outputs = []
        for buffer, tail, strides, dtype in first.outputs:
            typed = arena.view(dtype)
            start = (offsets[buffer.index] + buffer.offset) // typed.element_size()
            outputs.append(torch.as_strided(typed, (first.rows, *tail), strides,
                                            typed.storage_offset() + start))
        return cls(runtime, torch.from_numpy(table), [call.name for call in first.ops],
                   arena, outputs, list(first.stage_ends), first.rows)

    def run(self, rows: int, stages: int = 1) -> torch.Tensor:
        """Run the first ``stages`` stages for ``rows`` tokens; returns the last one's output.

        Outputs are ``[rows, ...]`` views of the graph's arena (``output``): the next run
        overwrites them; those of the earlier stages stay valid until then.
        """
        if not 0 < rows <= self.rows:
            raise ValueError(f"a step graph recorded for up to {self.rows} tokens cannot run "
                             f"{rows}")
        if not 0 < stages <= self.num_stages:
            raise ValueError(f"this step graph has {self.num_stages} stage(s), not {stages}")
        ops = self.ops[:self.stage_ends[stages - 1]]
        status = self.runtime.run_graph(ops, rows)
        if status:
            name, code, op = self.names[status // 256 - 1], status % 256, status // 256 - 1
            if code == 2 and name in ("rotary_embedding", "gather_rows"):
                raise IndexError(f"{name}: a position or token id is outside its table "
                                 f"(step graph op {op})")
            if code == 254:
                raise RuntimeError(f"{name}: called with a number of arguments it does not "
                                   f"take (step graph op {op})")
            raise RuntimeError(f"{name}: the function returned status {code} (step graph "
                               f"op {op})")
        return self.output(stages - 1, rows)

    def output(self, stage: int, rows: int) -> torch.Tensor:
        """Stage ``stage``'s output of the last run of ``rows`` tokens (0: the first)."""
        return self.outputs[stage][:rows]


def _row_masks(recordings: Sequence[_Recording]) -> list[tuple[int, dict[int, int]]]:
    """Per op of the first recording: which arguments are a multiple of the token count.

    The mask of those arguments, and the multiple of each.

    Raises:
        NotCapturable: the recordings differ in any other way.
    """
    first = recordings[0]
    sizes = first.sizes()
    for other in recordings[1:]:
        if [c.address for c in other.ops] != [c.address for c in first.ops]:
            raise NotCapturable(f"the forward pass makes different native calls for "
                                f"{first.rows} and {other.rows} tokens")
        if len(other.buffers) != len(first.buffers) or any(
                b > a for a, b in zip(sizes, other.sizes(), strict=True)):
            raise NotCapturable("the forward pass allocates differently for different token "
                                "counts")
        if other.outputs != first.outputs or other.stage_ends != first.stage_ends:
            raise NotCapturable("the forward pass returns its rows from different places "
                                "for different token counts")
    masks = []
    for i, call in enumerate(first.ops):
        mask, multiples = 0, {}
        for j, value in enumerate(call.values):
            seen = [r.ops[i].values[j] for r in recordings]
            multiple = _multiple_of_rows(seen, [r.rows for r in recordings])
            if multiple is not None:
                mask |= 1 << j
                multiples[j] = multiple
            elif any(v != value for v in seen):
                raise NotCapturable(f"argument {j} of {call.name} (call {i}) depends on the "
                                    f"token count other than by being it: {seen} for "
                                    f"{[r.rows for r in recordings]} tokens")
        masks.append((mask, multiples))
    return masks


def _multiple_of_rows(seen: Sequence[Any], rows: Sequence[int]) -> int | None:
    """``m`` when every recording's value is ``m`` times its token count (``m >= 1``)."""
    if len(seen) < 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in seen):
        return None
    multiple, remainder = divmod(seen[0], rows[0])
    if multiple < 1 or remainder or any(v != multiple * r for v, r in zip(seen, rows,
                                                                          strict=True)):
        return None
    return int(multiple)


def _lifetimes(recording: _Recording) -> list[tuple[int, int] | None]:
    """Per buffer, the first and last call that points into it (None: no call does)."""
    spans: list[tuple[int, int] | None] = [None] * len(recording.buffers)
    for i, call in enumerate(recording.ops):
        for value in call.values:
            if isinstance(value, _Buffer):
                span = spans[value.index]
                spans[value.index] = (i, i) if span is None else (span[0], i)
    end = len(recording.ops)
    for buffer, *_ in recording.outputs:  # read after the last call
        span = spans[buffer.index]
        spans[buffer.index] = (end, end) if span is None else (span[0], end)
    return spans


def _plan(recording: _Recording) -> tuple[list[int], int]:
    """Arena offsets of the buffers (those alive at once never overlap) and its size."""
    spans = _lifetimes(recording)
    sizes = [-(-s // ALIGN) * ALIGN for s in recording.sizes()]
    placed: list[tuple[int, int, int, int]] = []  # (offset, end, first, last)
    offsets = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda k: -sizes[k]):
        span = spans[index]
        if span is None:
            continue
        first, last = span
        clashes = sorted((o, e) for o, e, f, la in placed if f <= last and first <= la)
        offset = 0
        for start, end in clashes:
            if offset + sizes[index] <= start:
                break
            offset = max(offset, end)
        offsets[index] = offset
        placed.append((offset, offset + sizes[index], first, last))
    return offsets, max((end for _, end, _, _ in placed), default=0)


def _encode(value: Any, origin: int, offsets: list[int]) -> int:
    if value is None:
        return 0
    if isinstance(value, _Buffer):
        return origin + offsets[value.index] + value.offset
    return graph_calls.encode([value])[0]  # an address, an integer, or a float's 32 bits
