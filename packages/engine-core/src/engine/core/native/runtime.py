"""The CPU step graph's runtime: its interpreter and the calls a graph makes of its own.

``graph.cpp`` is built on first use by the SDK's ``engine.sdk.native``, as any kernel's
native code is: the interpreter calls function addresses (``engine.sdk.graph_calls``) and
names no kernel, so a graph records any kernel's calls, engine-kernels' or a plugin's, and
the runtime needs none of them. Its own calls are the row copies (``copy_rows``: a
``clone``, ``copy_`` or copying ``reshape`` in the pass) and the embedding's row gather
(``gather_rows``) and a scale of rows by a number (``scale_rows``: a lookup's rows times
the embedding's output scale), graph functions themselves: run eagerly, or recorded.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from engine.sdk.graph_calls import MAX_ARGS, GraphFunction
from engine.sdk.native import NativeBuildError, load_library

SOURCES = (Path(__file__).with_name("graph.cpp"),)
#: Arguments of a step graph's op (``kMaxArgs`` in graph.cpp, ``MAX_ARGS`` of the SDK's
#: graph functions), and its int64s in all: the function, the mask of arguments that are
#: the token count, the number of arguments, the arguments.
GRAPH_MAX_ARGS = MAX_ARGS
GRAPH_OP_WIDTH = 3 + GRAPH_MAX_ARGS
_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
#: gather_rows' status for an id outside the table (graph.cpp).
OUT_OF_TABLE = 2
#: scale_rows' dtype codes (graph.cpp).
SCALE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@functools.cache
def load_runtime() -> GraphRuntime:
    """The runtime, built on first use; raises ``NativeBuildError``."""
    return GraphRuntime(load_library("engine_graph_runtime", SOURCES))


@functools.cache
def graph_runtime() -> GraphRuntime | None:
    """The runtime, or None where it cannot be built here (``load_runtime()`` says why)."""
    try:
        return load_runtime()
    except NativeBuildError:
        return None


class GraphRuntime:
    """Typed calls into the built runtime."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._graph_run = lib.engine_graph_run
        self._graph_run.restype = _I64
        self._graph_run.argtypes = [_P, _I64, _I64, _I32]
        self._copy_call = GraphFunction.from_library(lib, "engine_graph_copy_rows", "copy_rows")
        self._gather_call = GraphFunction.from_library(lib, "engine_graph_gather_rows",
                                                       "gather_rows")
        self._scale_call = GraphFunction.from_library(lib, "engine_graph_scale_rows",
                                                      "scale_rows")

    def copy_rows(self, src: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` = ``src``: ``[rows, ...]`` views whose rows (``t[i]``) are contiguous."""
        if src.shape != out.shape or src.dtype != out.dtype or src.dim() == 0 or not (
                src.is_cpu and out.is_cpu and src[0].is_contiguous() and out[0].is_contiguous()):
            raise ValueError(f"copy_rows: expected two CPU views of one shape and dtype with "
                             f"contiguous rows, got {tuple(src.shape)} {src.dtype} and "
                             f"{tuple(out.shape)} {out.dtype}")
        size = src.element_size()
        _check_status("copy_rows", self._copy_call(
            src, src.stride(0) * size, out, out.stride(0) * size, src.shape[0],
            src[0].numel() * size))

    def gather_rows(self, table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> None:
        """``out[t]`` = ``table[ids[t]]``: an embedding lookup.

        An id outside the table is an IndexError (nothing is written).

        ``table``: ``[V, D]`` with contiguous rows; ``ids``: int64 ``[T]``, contiguous;
        ``out``: ``[T, D]`` of the table's dtype with contiguous rows.
        """
        rows, width = out.shape
        if (table.dim() != 2 or table.shape[1] != width or table.dtype != out.dtype
                or table.stride(1) != 1 or out.stride(1) != 1 or not table.is_cpu
                or not out.is_cpu):
            raise ValueError(f"gather_rows: expected a [V, {width}] table and a [{rows}, "
                             f"{width}] output, CPU tensors of one dtype with contiguous rows, "
                             f"got {tuple(table.shape)} {table.dtype} and {tuple(out.shape)} "
                             f"{out.dtype}")
        if ids.dtype != torch.int64 or ids.shape != (rows,) or not ids.is_contiguous():
            raise ValueError(f"gather_rows: expected contiguous int64 ids [{rows}], got "
                             f"{tuple(ids.shape)} {ids.dtype}")
        size = table.element_size()
        status = self._gather_call(table, table.stride(0) * size, table.shape[0], ids, rows,
                                   out, out.stride(0) * size, width * size)
        if status == OUT_OF_TABLE:
            raise IndexError(f"gather_rows: an id is outside the table (0..{table.shape[0] - 1})")
        _check_status("gather_rows", status)

    def scale_rows(self, src: torch.Tensor, factor: float, out: torch.Tensor) -> None:
        """``out`` = ``src * factor`` as torch computes it (``src`` may be ``out``).

        Each element is widened to float32, multiplied by ``factor`` as a float32 and
        rounded once to the dtype. ``src`` and ``out``: ``[rows, ...]`` CPU views of one
        shape and dtype (float32, bfloat16 or float16) whose rows are contiguous.
        """
        if (src.shape != out.shape or src.dtype != out.dtype or src.dim() == 0
                or src.dtype not in SCALE_DTYPES or not (
                    src.is_cpu and out.is_cpu and src[0].is_contiguous()
                    and out[0].is_contiguous())):
            raise ValueError(f"scale_rows: expected two CPU views of one shape and dtype "
                             f"({', '.join(str(d) for d in SCALE_DTYPES)}) with contiguous "
                             f"rows, got {tuple(src.shape)} {src.dtype} and "
                             f"{tuple(out.shape)} {out.dtype}")
        size = src.element_size()
        _check_status("scale_rows", self._scale_call(
            src, src.stride(0) * size, out, out.stride(0) * size, src.shape[0],
            src[0].numel(), SCALE_DTYPES[src.dtype], float(factor)))

    def run_graph(self, ops: torch.Tensor, rows: int) -> int:
        """Run a recorded step graph (``engine.core.native.graph``) for ``rows`` tokens.

        ``ops``: contiguous int64 ``[num_ops, GRAPH_OP_WIDTH]``. Each call is told it may
        use ``torch.get_num_threads()`` threads. Returns 0, or (index of the failing op + 1)
        * 256 + that call's status.
        """
        return int(self._graph_run(ops.data_ptr(), ops.shape[0], rows,
                                   torch.get_num_threads()))


def _check_status(call: str, status: int) -> None:
    if status:  # the library and this wrapper disagree: a stale or foreign build
        raise RuntimeError(f"{call}: the graph runtime refused its arguments (status {status})")


__all__ = ["GRAPH_MAX_ARGS", "GRAPH_OP_WIDTH", "GraphRuntime", "graph_runtime", "load_runtime"]
