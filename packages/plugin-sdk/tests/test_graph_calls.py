"""``engine.sdk.graph_calls``: a ``GraphFunction`` runs its C function, or is recorded.

The functions here are Python callbacks with the graph's C ABI (a real function address,
no compiler needed): they see exactly the int64s a C function would.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from engine.sdk import graph_calls
from engine.sdk.graph_calls import MAX_ARGS, GraphFunction, GraphValue, Pointer, encode

ABI = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int64), ctypes.c_int64,
                       ctypes.c_int)


class Seen:
    """A C-ABI function that keeps what it was called with and returns ``status``."""

    def __init__(self, status: int = 0) -> None:
        self.calls: list[tuple[list[int], int]] = []
        self.status = status
        self.callback = ABI(self)  # kept alive as long as the function is used
        self.address = int(ctypes.cast(self.callback, ctypes.c_void_p).value or 0)

    def __call__(self, args: Any, num_args: int, max_threads: int) -> int:
        self.calls.append(([args[i] for i in range(num_args)], max_threads))
        return self.status


class ListRecorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, list[GraphValue]]] = []

    def record_call(self, function: GraphFunction, args: Sequence[GraphValue]) -> None:
        self.calls.append((function.name, list(args)))


def float_bits(value: float) -> int:
    return int(struct.unpack("<I", struct.pack("<f", value))[0])


def test_an_eager_call_passes_each_argument_as_the_abi_says() -> None:
    seen = Seen()
    x = torch.zeros(4, 3)
    function = GraphFunction(seen.address, "acme.fn")
    assert function(x, x[1], None, ctypes.c_void_p(64), 7, True, 0.5, ctypes.c_float(2.0),
                    -3, max_threads=2) == 0
    assert seen.calls == [([x.data_ptr(), x[1].data_ptr(), 0, 64, 7, 1, float_bits(0.5),
                            float_bits(2.0), -3], 2)]


def test_an_eager_call_returns_the_status_and_uses_torchs_threads_by_default() -> None:
    seen = Seen(status=7)
    assert GraphFunction(seen.address, "acme.fn")(1) == 7
    assert seen.calls == [([1], torch.get_num_threads())]


def test_while_recording_the_call_goes_to_the_recorder_and_nothing_runs() -> None:
    seen = Seen()
    x = torch.zeros(2, 2)
    function = GraphFunction(seen.address, "acme.fn")
    recorder = ListRecorder()
    with graph_calls.recording(recorder):
        assert graph_calls.is_recording()
        assert function(x, None, 3, 1.5) == 0
    assert not graph_calls.is_recording()
    assert seen.calls == []
    assert recorder.calls == [("acme.fn", [Pointer(x.data_ptr()), Pointer(0), 3, 1.5])]
    assert encode(recorder.calls[0][1]) == [x.data_ptr(), 0, 3, float_bits(1.5)]


def test_recordings_do_not_nest() -> None:
    with graph_calls.recording(ListRecorder()), pytest.raises(RuntimeError, match="already"):
        with graph_calls.recording(ListRecorder()):
            pass
    assert not graph_calls.is_recording()


@pytest.mark.parametrize(("args", "error", "match"), [
    (("text",), TypeError, r"'acme.fn': argument 0 is a str; pass a tensor, None or "
                           r"ctypes.c_void_p \(a pointer\), an int, or a float"),
    ((1 << 63,), ValueError, r"argument 0 \(9223372036854775808\) does not fit an int64"),
    (tuple(range(MAX_ARGS + 1)), ValueError, rf"25 arguments; a graph function takes at most "
                                             rf"{MAX_ARGS}"),
])
def test_bad_arguments_are_refused_before_the_call(args: tuple[Any, ...], error: type,
                                                   match: str) -> None:
    seen = Seen()
    with pytest.raises(error, match=match):
        GraphFunction(seen.address, "acme.fn")(*args)
    assert seen.calls == []


def test_an_address_must_be_a_functions() -> None:
    with pytest.raises(ValueError, match=r"'acme.fn': the address must be a function's"):
        GraphFunction(0, "acme.fn")


def test_from_library_finds_the_symbol_and_names_the_function_by_it() -> None:
    libc = ctypes.CDLL(None)
    function = GraphFunction.from_library(libc, "abs")  # any symbol: it is not called
    assert function.name == "abs" and function.address > 0
    with pytest.raises(AttributeError):
        GraphFunction.from_library(libc, "no_such_symbol_here")
