"""The engine's built-in custom ops: the SDK's contracts, with C++ paths on the CPU.

A model's ``rms_norm``, ``rotary_embedding`` and ``silu_and_mul`` are built from these
classes unless a replacement is in use (``engine.core.custom_op_selection``). Each
subclasses its contract in ``engine.sdk.ops`` and overrides only ``forward_cpu``, so the
reference (``forward_native``) and every other device's path stay the contract's.

``forward_cpu`` runs the engine's CPU kernels (``engine.core.native``, ``elementwise.cpp``):
one pass over the data instead of torch's four to six elementwise ops, RMSNorm and
rotation in place (the contracts allow it). Where a call is outside what the kernels take
(float32 or bfloat16; 2-D rows with a contiguous last axis, for ``rms_norm`` any
``[..., n]`` that views as ``[-1, n]`` rows, e.g. per-head ``[tokens, heads, head_size]``;
the weight or the cos/sin cache in the kernel's dtype; no autograd graph to record) or
the kernels cannot be built here (no C++ compiler: the ``cpu`` attention backend's
fallback WARNING says why), it runs the reference, so results never depend on whether a
compiler is installed beyond float32 rounding order.

Each declares that a graph may record it (``capture_support``, ``engine.sdk.capture``):
the CPU step graph where it runs its ``forward_cpu``, CUDA graphs where it runs the
contract's reference.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch

from engine.core.native import native_kernels
from engine.core.native.library import DTYPE_CODES
from engine.sdk.capture import CaptureContext, GraphKind
from engine.sdk.ops import CustomOp, RMSNormOp, RotaryEmbeddingOp, SiluAndMulOp
from engine.sdk.support import Support


def _rows(t: torch.Tensor) -> bool:
    """Whether the kernels take ``t`` as it is: 2-D float32/bfloat16, contiguous last axis."""
    return t.dim() == 2 and t.stride(1) == 1 and t.dtype in DTYPE_CODES


def _as_rows(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as the 2-D rows the kernels take (``[..., n]`` viewed as ``[-1, n]``), or None.

    E.g. per-head norms: ``[tokens, heads, head_size]`` with contiguous heads is
    ``[tokens * heads, head_size]`` rows.
    """
    if t.dim() != 2:
        if t.dim() < 2:
            return None
        try:
            t = t.view(-1, t.shape[-1])
        except RuntimeError:  # the leading dimensions do not collapse into one stride
            return None
    return t if _rows(t) else None


def _recording(*tensors: torch.Tensor) -> bool:
    """Whether autograd would record a graph through these (the kernels record none)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _capture_support(op: CustomOp, ctx: CaptureContext, cpu: Callable[..., Any],
                     contract: type[CustomOp]) -> Support:
    """A built-in op's answer: what it runs must be its own CPU kernel or the reference.

    The CPU step graph records ``cpu`` (this class's ``forward_cpu``: the engine's kernel),
    CUDA graphs the contract's reference, as ``forward_cuda`` runs it unless overridden.
    A subclass that overrides the method the answer is about is refused until it answers.
    """
    chosen = getattr(op._forward_impl, "__func__", None)
    cls = type(op)
    if ctx.kind is GraphKind.CPU_STEP_GRAPH:
        if chosen is cpu:
            return Support.yes()
        return Support.no(f"it runs {op.method_for(op.dispatch_key)}, not the engine's CPU "
                          f"kernel ({cpu.__qualname__})")
    if ctx.kind is GraphKind.CUDA_GRAPHS and chosen is CustomOp.forward_cuda and (
            cls.forward_native is contract.forward_native):
        return Support.yes()
    return Support.no(f"it runs {op.method_for(op.dispatch_key)}, not the contract's "
                      f"reference {contract.__qualname__}.forward_native (a class that "
                      f"overrides it declares for itself)")


class RMSNorm(RMSNormOp):
    """``rms_norm``: the contract, with the CPU path in one fused in-place kernel."""

    name: ClassVar[str] = "rms_norm"

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None
                    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        kernels = native_kernels()
        rows = _as_rows(x)
        residual_rows = None if residual is None else _as_rows(residual)
        if (kernels is None or rows is None or self.weight.dtype != x.dtype
                or _recording(x, self.weight)
                or (residual is not None and (residual_rows is None
                                              or residual.dtype != x.dtype
                                              or residual.shape != x.shape
                                              or residual.requires_grad))):
            return self.forward_native(x, residual)
        kernels.rms_norm(rows, residual_rows, self.weight, self.eps)  # in place, through views
        return x if residual is None else (x, residual)

    def capture_support(self, ctx: CaptureContext) -> Support:
        return _capture_support(self, ctx, RMSNorm.forward_cpu, RMSNormOp)


class RotaryEmbedding(RotaryEmbeddingOp):
    """``rotary_embedding``: the contract, rotating in place on the CPU in one kernel."""

    name: ClassVar[str] = "rotary_embedding"

    def forward_cpu(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        kernels = native_kernels()
        cache = self.cos_sin_cache
        if (kernels is None or cache.dtype != torch.float32 or not cache.is_contiguous()
                or positions.dtype != torch.int64 or positions.dim() != 1
                or not positions.is_contiguous() or query.dim() != 3 or key.dim() != 3
                or query.stride(2) != 1 or key.stride(2) != 1 or key.dtype != query.dtype
                or query.dtype not in DTYPE_CODES or _recording(query, key)):
            return self.forward_native(positions, query, key)
        kernels.rotary_embedding(positions, query, key, cache, self.rotary_dim,
                                 self.is_neox_style)
        return query, key

    def capture_support(self, ctx: CaptureContext) -> Support:
        return _capture_support(self, ctx, RotaryEmbedding.forward_cpu, RotaryEmbeddingOp)


class SiluAndMul(SiluAndMulOp):
    """``silu_and_mul``: the contract, with the CPU path in one kernel."""

    name: ClassVar[str] = "silu_and_mul"

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        kernels = native_kernels()
        width = x.shape[-1] if x.dim() else 1
        rows = x.reshape(-1, width) if x.dim() else x
        if (kernels is None or width % 2 or not _rows(rows) or _recording(x)):
            return self.forward_native(x)
        out = x.new_empty((*x.shape[:-1], width // 2))
        kernels.silu_and_mul(rows, out.view(-1, width // 2))
        return out

    def capture_support(self, ctx: CaptureContext) -> Support:
        return _capture_support(self, ctx, SiluAndMul.forward_cpu, SiluAndMulOp)


#: The class each built-in op is built from when no replacement is in use.
BUILTIN_IMPLEMENTATIONS: Mapping[str, type[CustomOp]] = {
    op.name: op for op in (RMSNorm, RotaryEmbedding, SiluAndMul)
}

__all__ = ["BUILTIN_IMPLEMENTATIONS", "RMSNorm", "RotaryEmbedding", "SiluAndMul",
           "native_kernels"]
