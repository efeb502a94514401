"""What every kernel module shares: triton imported, the interpreter state, dot dtypes.

Imports triton: only the ``*_kernels.py`` modules import this one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._triton import interpreting


def _interpreted() -> bool:
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4; older ones read the env var
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return interpreting()


#: Whether the kernels defined from now on run in Triton's interpreter (read once, as
#: ``@triton.jit`` reads it when each kernel module is imported).
INTERPRETED: bool = _interpreted()

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """Operand dtype of ``tl.dot`` for inputs of ``dtype``.

    The input dtype on a GPU (bf16/fp16 tensor cores). In the interpreter always float32:
    it computes bfloat16 as raw 16-bit integers (wrong values), so its operands are
    widened; the result is the float32-accumulated product either way.
    """
    if INTERPRETED:
        return tl.float32
    return _TL_DTYPES[dtype]


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (``tl.arange`` sizes must be powers of two)."""
    return int(triton.next_power_of_2(n))
