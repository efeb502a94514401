"""What the CPU kernels' Python wrappers share: run a call (or record it), check its status.

The library itself is built by the SDK's :mod:`engine.sdk.native`, as a plugin's native
code is; ``invoke`` runs a ctypes function or, while a CPU step graph is recorded, the
kernel's step-graph entry (:mod:`engine.sdk.graph_calls`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from engine.sdk.graph_calls import GraphFunction, RecordingRefused, is_recording


def invoke(kernel: str, entry: Callable[..., int | None], function: GraphFunction | None,
           *args: object) -> int:
    """Call the ctypes function ``entry``, or record its step-graph entry ``function``.

    While a step graph is recorded the call of ``function`` with the same arguments is
    recorded instead (``entry.argtypes`` say which are pointers and floats). Returns the
    status (0 when recorded).

    Raises:
        RecordingRefused: a recording reached a kernel without a step-graph entry.
    """
    if is_recording():
        if function is None:
            raise RecordingRefused(f"the native kernel {kernel} has no step-graph entry")
        argtypes = entry.argtypes  # type: ignore[attr-defined]
        return function(*(ctypes.c_void_p(int(value or 0))  # type: ignore[call-overload]
                          if ctype is ctypes.c_void_p
                          else float(value) if ctype is ctypes.c_float  # type: ignore[arg-type]
                          else int(value)  # type: ignore[call-overload]
                          for value, ctype in zip(args, argtypes, strict=True)))
    status = entry(*args)
    return 0 if status is None else status


def call_status(kernel: str, status: int) -> None:
    """Raise for a library call's nonzero status, naming the call."""
    if status:  # the library and its Python wrapper disagree: a stale or foreign build
        raise RuntimeError(f"{kernel}: the library refused its arguments (status {status})")


def check_rows(kernel: str, dtype: torch.dtype, width: int, *tensors: torch.Tensor) -> None:
    """Refuse anything but ``[rows, width]`` CPU views of ``dtype`` with contiguous rows."""
    rows = tensors[0].shape[0]
    for t in tensors:
        if (t.dim() != 2 or t.shape[0] != rows or t.shape[1] != width or t.stride(1) != 1
                or t.dtype != dtype or not t.is_cpu):
            raise ValueError(
                f"{kernel}: expected [{rows}, {width}] {dtype} CPU tensors with contiguous rows, "
                f"got {[(tuple(t.shape), t.stride(), t.dtype, t.device.type) for t in tensors]}")


__all__ = ["call_status", "check_rows", "invoke"]
