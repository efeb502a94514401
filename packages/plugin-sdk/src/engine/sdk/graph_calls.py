"""C functions the CPU step graph records: how a kernel's own native code joins the graph.

The CPU step graph (:attr:`GraphKind.CPU_STEP_GRAPH <engine.sdk.capture.GraphKind>`)
records a forward pass once as a list of C calls with every pointer fixed, and replays
that list in C for each later step of up to the recorded number of tokens: one call from
Python a step instead of a few Python-wrapped calls per layer. The engine's own CPU
kernels join it through this module, and a plugin's kernel (linear kernel, custom op,
attention implementation) joins it the same way: it calls its C code through a
:class:`GraphFunction` instead of ``ctypes`` directly. Called eagerly, a ``GraphFunction``
runs the function; while the engine records a pass, it hands the call to the recorder
instead, which keeps it in the graph.

The function's C signature (the graph's ABI)::

    int fn(const int64_t* args, int64_t num_args, int max_threads);

* ``args``: the call's arguments, in the order given to the ``GraphFunction``, each one
  int64: a pointer as its address, an integer as it is, a float as its 32 bits (IEEE
  single, in the low half). At most :data:`MAX_ARGS`.
* An argument that is a fixed multiple of the step's token count (the rows of the call;
  the rows of a per-head view, tokens times heads) is recognised by the recording, which
  records the pass at several token counts, and set for each replay's count. Any other
  argument must be the same at every count (a pointer to a last row, or a value that
  branches on the count, makes the recording refuse the pass, naming the function).
* Pointers must point into memory a replay can reach: the model's parameters and
  buffers, the tensors a component holds, the KV cache, the graph's inputs, or the
  buffers the pass allocates (which the graph lays out in one arena).
* ``max_threads``: the most threads the call may use now (the CPUs the engine left the
  worker this step). A function running an OpenMP region passes ``num_threads(n)`` with
  ``n`` at most that.
* Returns 0, or a status from 1 to 255: the engine stops the step and reports it, naming
  the function.

A component that calls its C code this way, and otherwise only makes views, allocations
and copies of tensors, can answer yes to ``capture_support`` for the CPU step graph (any
other torch op that computes is refused by the recorder, naming the op). The engine still
replays the graph once against the eager pass before using it.

.. versionadded:: 1.1
"""

from __future__ import annotations

import contextlib
import ctypes
import struct
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["MAX_ARGS", "CallRecorder", "GraphFunction", "GraphValue", "Pointer",
           "RecordingRefused", "encode", "is_recording", "recording"]

MAX_ARGS = 24
"""The most arguments a graph function takes.

.. versionadded:: 1.1
"""

_ABI = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int64), ctypes.c_int64,
                        ctypes.c_int)


@dataclass(frozen=True)
class Pointer:
    """An argument that is an address (0: a null pointer).

    ``GraphFunction`` calls take a tensor (its ``data_ptr()``), ``None`` or a
    ``ctypes.c_void_p`` for a pointer; a recorder receives each as a ``Pointer``.

    .. versionadded:: 1.1
    """

    address: int


GraphValue = Pointer | int | float
"""What a recorder receives per argument: a pointer, an integer, or a float (32 bits).

.. versionadded:: 1.1
"""


class RecordingRefused(Exception):
    """The pass being recorded cannot be a graph; the message says what in it stopped it.

    A recorder raises it for a call it cannot keep; a component's own code raises it when
    it is reached while recording (:func:`is_recording`) on a path that has no
    :class:`GraphFunction` (a kernel it can only call through ``ctypes``, say). The engine
    then runs the model eagerly, logging the message with the component's plugin named.

    .. versionadded:: 1.1
    """


class CallRecorder(Protocol):
    """What takes a :class:`GraphFunction`'s calls while the engine records a pass.

    The engine is the only implementation; a plugin's own tests may install one
    (:func:`recording`) to see what its kernel's calls record.

    .. versionadded:: 1.1
    """

    def record_call(self, function: GraphFunction, args: Sequence[GraphValue]) -> None:
        """Keep the call of ``function`` with ``args`` in the recording.

        Raises whatever refuses it (a pointer into memory a replay cannot reach).
        """


_RECORDER: ContextVar[CallRecorder | None] = ContextVar("engine_graph_recorder",
                                                        default=None)


def is_recording() -> bool:
    """Whether :class:`GraphFunction` calls made here are being recorded, not run.

    .. versionadded:: 1.1
    """
    return _RECORDER.get() is not None


@contextlib.contextmanager
def recording(recorder: CallRecorder) -> Iterator[CallRecorder]:
    """In this block (this thread and context), ``GraphFunction`` calls go to ``recorder``.

    Raises:
        RuntimeError: a recording is already under way here.

    .. versionadded:: 1.1
    """
    if _RECORDER.get() is not None:
        raise RuntimeError("a step graph is already being recorded here")
    token = _RECORDER.set(recorder)
    try:
        yield recorder
    finally:
        _RECORDER.reset(token)


class GraphFunction:
    """A C function with the graph's ABI (above), called eagerly or recorded.

    Args:
        address: The function's address (``ctypes.cast(lib.fn, ctypes.c_void_p).value``).
        name: How errors and the engine's logs name it (e.g. ``"my_plugin.matmul"``).

    .. versionadded:: 1.1
    """

    def __init__(self, address: int, name: str) -> None:
        if not isinstance(address, int) or address <= 0:
            raise ValueError(f"GraphFunction {name!r}: the address must be a function's "
                             f"(a positive int), got {address!r}")
        self.address = address
        self.name = name
        self._function = _ABI(address)

    @classmethod
    def from_library(cls, library: ctypes.CDLL, symbol: str,
                     name: str | None = None) -> GraphFunction:
        """The function ``symbol`` of a loaded shared library (named ``symbol`` by default).

        Raises:
            AttributeError: the library has no such symbol.
        """
        address = ctypes.cast(getattr(library, symbol), ctypes.c_void_p).value
        return cls(int(address or 0), name or symbol)

    def __call__(self, *args: Any, max_threads: int | None = None) -> int:
        """Run the function on ``args``, or record the call while a pass is recorded.

        Args:
            args: Each a tensor (a pointer to its first element), ``None`` or a
                ``ctypes.c_void_p`` (a pointer), an ``int`` or ``bool`` (an integer), a
                ``float`` or ``ctypes.c_float`` (a float, kept in 32 bits).
            max_threads: Threads the function may use when run now; default torch's
                thread count (``torch.get_num_threads()``).

        Returns:
            The function's status (0: done); 0 when recorded (nothing ran).

        Raises:
            TypeError: an argument is none of the above.
            ValueError: more than :data:`MAX_ARGS` arguments, or an integer outside int64.
        """
        values = self._values(args)
        recorder = _RECORDER.get()
        if recorder is not None:
            recorder.record_call(self, values)
            return 0
        if max_threads is None:
            import torch

            max_threads = torch.get_num_threads()
        packed = (ctypes.c_int64 * max(len(values), 1))(*encode(values))
        return int(self._function(packed, len(values), max_threads))

    def _values(self, args: Sequence[Any]) -> list[GraphValue]:
        if len(args) > MAX_ARGS:
            raise ValueError(f"GraphFunction {self.name!r}: {len(args)} arguments; a graph "
                             f"function takes at most {MAX_ARGS}")
        return [_value(self.name, i, arg) for i, arg in enumerate(args)]

    def __repr__(self) -> str:
        return f"GraphFunction({self.name!r}, address={self.address:#x})"


def _value(name: str, index: int, arg: Any) -> GraphValue:
    if arg is None:
        return Pointer(0)
    if isinstance(arg, Pointer):
        return arg
    if isinstance(arg, ctypes.c_void_p):
        return Pointer(arg.value or 0)
    if isinstance(arg, ctypes.c_float):
        return float(arg.value)
    if isinstance(arg, bool):
        return int(arg)
    if isinstance(arg, int):
        if not -(1 << 63) <= arg < (1 << 63):
            raise ValueError(f"GraphFunction {name!r}: argument {index} ({arg}) does not fit "
                             f"an int64")
        return arg
    if isinstance(arg, float):
        return arg
    data_ptr = getattr(arg, "data_ptr", None)
    if callable(data_ptr):
        return Pointer(int(data_ptr()))
    raise TypeError(f"GraphFunction {name!r}: argument {index} is a {type(arg).__name__}; "
                    f"pass a tensor, None or ctypes.c_void_p (a pointer), an int, or a "
                    f"float")


def encode(values: Sequence[GraphValue]) -> list[int]:
    """``values`` as the int64s the function receives (see the module's ABI).

    .. versionadded:: 1.1
    """
    out = []
    for value in values:
        if isinstance(value, Pointer):
            out.append(value.address)
        elif isinstance(value, float):
            out.append(struct.unpack("<I", struct.pack("<f", value))[0])
        else:
            out.append(value)
    return out
