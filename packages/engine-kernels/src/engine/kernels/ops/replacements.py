"""Custom-op replacements (``engine.custom_ops``): the SDK's ops with Triton CUDA paths.

Each subclasses its SDK contract and overrides only ``forward_cuda``; every other dispatch
key (the CPU, out-of-tree devices, ``native``) keeps the reference. Built with the
``cuda`` key (the CUDA platform's device type), an op checks that triton is installed,
so a CUDA install without it stops while the model is built, saying what to install or
which ``--custom-ops`` item turns the op off, rather than failing in the first forward.

The kernels (``op_kernels``) are imported on first use: this module imports no triton.

Each declares that CUDA graphs may capture its Triton path (``capture_support``,
``engine.sdk.capture``); its reference paths declare nothing.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from engine.kernels._triton import INSTALL_HINT, triton_installed
from engine.sdk.capture import CaptureContext, GraphKind
from engine.sdk.ops import NATIVE, CustomOp, RMSNormOp, RotaryEmbeddingOp, SiluAndMulOp
from engine.sdk.support import Support


def _require_triton(name: str, dispatch_key: str) -> None:
    if dispatch_key == "cuda" and not triton_installed():
        raise RuntimeError(
            f"engine-kernels' {name} replacement runs Triton kernels on CUDA, but triton is "
            f"not installed: {INSTALL_HINT}; or build the model with the reference op "
            f"(--custom-ops=-{name})")


def _capture_support(op: CustomOp, ctx: CaptureContext) -> Support:
    """CUDA graphs, where the op runs its Triton kernel (launches only, no host sync)."""
    if ctx.kind is GraphKind.CUDA_GRAPHS and op.dispatch_key == "cuda":
        return Support.yes()
    return Support.no(f"it runs {op.method_for(op.dispatch_key)}, a torch reference; only its "
                      f"Triton path on CUDA declares graph capture")


class TritonRMSNorm(RMSNormOp):
    """``rms_norm`` with one Triton kernel per call (the residual add fused, in place)."""

    name: ClassVar[str] = "rms_norm"

    def __init__(self, hidden_size: int, eps: float = 1e-6, *,
                 dtype: torch.dtype | None = None, dispatch_key: str = NATIVE) -> None:
        _require_triton(self.name, dispatch_key)
        super().__init__(hidden_size, eps, dtype=dtype, dispatch_key=dispatch_key)

    def forward_cuda(self, x: torch.Tensor, residual: torch.Tensor | None = None
                     ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        from engine.kernels.ops.op_kernels import rms_norm

        y = rms_norm(x, self.weight, self.eps, residual)
        return y if residual is None else (y, residual)

    def capture_support(self, ctx: CaptureContext) -> Support:
        return _capture_support(self, ctx)


class TritonRotaryEmbedding(RotaryEmbeddingOp):
    """``rotary_embedding`` rotating queries and keys in place, one program per token."""

    name: ClassVar[str] = "rotary_embedding"

    def __init__(self, head_size: int, rotary_dim: int, cos_sin_cache: torch.Tensor,
                 is_neox_style: bool = True, *, dispatch_key: str = NATIVE) -> None:
        _require_triton(self.name, dispatch_key)
        super().__init__(head_size, rotary_dim, cos_sin_cache, is_neox_style,
                         dispatch_key=dispatch_key)

    def forward_cuda(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        from engine.kernels.ops.op_kernels import rotary_embedding

        for x in (query, key):
            rotary_embedding(positions, x, self.cos_sin_cache, self.rotary_dim,
                             self.is_neox_style)
        return query, key

    def capture_support(self, ctx: CaptureContext) -> Support:
        return _capture_support(self, ctx)


class TritonSiluAndMul(SiluAndMulOp):
    """``silu_and_mul`` in one Triton kernel (no intermediate ``silu`` tensor)."""

    name: ClassVar[str] = "silu_and_mul"

    def __init__(self, *, dispatch_key: str = NATIVE) -> None:
        _require_triton(self.name, dispatch_key)
        super().__init__(dispatch_key=dispatch_key)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        from engine.kernels.ops.op_kernels import silu_and_mul

        return silu_and_mul(x)

    def capture_support(self, ctx: CaptureContext) -> Support:
        return _capture_support(self, ctx)
