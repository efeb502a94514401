"""The engine's built-in custom ops: the SDK's contracts, with C++ paths on the CPU.

A model's ``rms_norm``, ``rotary_embedding`` and ``silu_and_mul`` are built from these
classes unless a replacement is in use (``engine.core.custom_op_selection``). Each
subclasses its contract in ``engine.sdk.ops`` and overrides only ``forward_cpu``, so the
reference (``forward_native``) and every other device's path stay the contract's.

``forward_cpu`` runs the engine's CPU kernels (``engine.core.native``, ``elementwise.cpp``):
one pass over the data instead of torch's four to six elementwise ops, RMSNorm and
rotation in place (the contracts allow it). Where a call is outside what the kernels take
(float32 or bfloat16; 2-D rows with a contiguous last axis; the weight or the cos/sin cache
in the kernel's dtype; no autograd graph to record) or the kernels cannot be built here
(no C++ compiler: the ``cpu`` attention backend's fallback WARNING says why), it runs the
reference, so results never depend on whether a compiler is installed beyond float32
rounding order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch

from engine.core.native import native_kernels
from engine.core.native.library import DTYPE_CODES
from engine.sdk.ops import CustomOp, RMSNormOp, RotaryEmbeddingOp, SiluAndMulOp


def _rows(t: torch.Tensor) -> bool:
    """Whether the kernels take ``t`` as it is: 2-D float32/bfloat16, contiguous last axis."""
    return t.dim() == 2 and t.stride(1) == 1 and t.dtype in DTYPE_CODES


def _recording(*tensors: torch.Tensor) -> bool:
    """Whether autograd would record a graph through these (the kernels record none)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


class RMSNorm(RMSNormOp):
    """``rms_norm``: the contract, with the CPU path in one fused in-place kernel."""

    name: ClassVar[str] = "rms_norm"

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None
                    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        kernels = native_kernels()
        if (kernels is None or not _rows(x) or self.weight.dtype != x.dtype
                or _recording(x, self.weight)
                or (residual is not None and (not _rows(residual) or residual.dtype != x.dtype
                                              or residual.shape != x.shape
                                              or residual.requires_grad))):
            return self.forward_native(x, residual)
        kernels.rms_norm(x, residual, self.weight, self.eps)
        return x if residual is None else (x, residual)


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


#: The class each built-in op is built from when no replacement is in use.
BUILTIN_IMPLEMENTATIONS: Mapping[str, type[CustomOp]] = {
    op.name: op for op in (RMSNorm, RotaryEmbedding, SiluAndMul)
}

__all__ = ["BUILTIN_IMPLEMENTATIONS", "RMSNorm", "RotaryEmbedding", "SiluAndMul",
           "native_kernels"]
