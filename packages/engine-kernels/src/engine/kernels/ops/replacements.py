"""engine-kernels' custom ops (``engine.custom_ops``): C++ on the CPU, Triton on CUDA.

One class per op, as a device-specific op is in vLLM: each subclasses its CPU class
(``engine.kernels.cpu.ops``: the SDK contract with ``forward_cpu`` in C++) and adds
``forward_cuda``, a Triton kernel; every other dispatch key (out-of-tree devices,
``native``) keeps the contract's reference. Built with the ``cuda`` key (the CUDA
platform's device type), an op checks that triton is installed, so a CUDA install without
it stops while the model is built, saying what to install or which ``--custom-ops`` item
turns the op off, rather than failing in the first forward.

The Triton kernels (``op_kernels``) are imported on first use: this module imports no
triton.

Each declares what a graph may record (``capture_support``, ``engine.sdk.capture``): CUDA
graphs its Triton path, the CPU step graph its C++ path.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch

from engine.kernels._triton import INSTALL_HINT, triton_installed
from engine.kernels.cpu.moe import CpuFusedMoE
from engine.kernels.cpu.ops import CpuGeluAndMul, CpuRMSNorm, CpuRotaryEmbedding, CpuSiluAndMul
from engine.sdk.capture import CaptureContext, GraphKind
from engine.sdk.ops import NATIVE, CustomOp
from engine.sdk.support import Support


def _require_triton(name: str, dispatch_key: str) -> None:
    if dispatch_key == "cuda" and not triton_installed():
        raise RuntimeError(
            f"engine-kernels' {name} runs Triton kernels on CUDA, but triton is "
            f"not installed: {INSTALL_HINT}; or build the model with the reference op "
            f"(--custom-ops=-{name})")


def _cuda_capture_support(op: CustomOp, ctx: CaptureContext) -> Support:
    """CUDA graphs, where the op runs its Triton kernel (launches only, no host sync)."""
    if op.dispatch_key == "cuda":
        return Support.yes()
    return Support.no(f"it runs {op.method_for(op.dispatch_key)}, not its Triton path (only "
                      f"that declares CUDA graph capture)")


class RMSNorm(CpuRMSNorm):
    """``rms_norm``: on CUDA one Triton kernel per call (the residual add fused, in place)."""

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
        if ctx.kind is GraphKind.CUDA_GRAPHS:
            return _cuda_capture_support(self, ctx)
        return super().capture_support(ctx)


class RotaryEmbedding(CpuRotaryEmbedding):
    """``rotary_embedding``: on CUDA rotating queries and keys in place, a program per token."""

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
        if ctx.kind is GraphKind.CUDA_GRAPHS:
            return _cuda_capture_support(self, ctx)
        return super().capture_support(ctx)


class SiluAndMul(CpuSiluAndMul):
    """``silu_and_mul``: on CUDA one Triton kernel (no intermediate ``silu`` tensor)."""

    name: ClassVar[str] = "silu_and_mul"

    def __init__(self, *, dispatch_key: str = NATIVE) -> None:
        _require_triton(self.name, dispatch_key)
        super().__init__(dispatch_key=dispatch_key)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        from engine.kernels.ops.op_kernels import silu_and_mul

        return silu_and_mul(x)

    def capture_support(self, ctx: CaptureContext) -> Support:
        if ctx.kind is GraphKind.CUDA_GRAPHS:
            return _cuda_capture_support(self, ctx)
        return super().capture_support(ctx)


class GeluAndMul(CpuGeluAndMul):
    """``gelu_and_mul``: on CUDA one Triton kernel (erf or tanh form, no intermediate)."""

    name: ClassVar[str] = "gelu_and_mul"

    def __init__(self, approximate: Literal["none", "tanh"] = "none", *,
                 dispatch_key: str = NATIVE) -> None:
        _require_triton(self.name, dispatch_key)
        super().__init__(approximate, dispatch_key=dispatch_key)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        from engine.kernels.ops.op_kernels import gelu_and_mul

        return gelu_and_mul(x, self.approximate)

    def capture_support(self, ctx: CaptureContext) -> Support:
        if ctx.kind is GraphKind.CUDA_GRAPHS:
            return _cuda_capture_support(self, ctx)
        return super().capture_support(ctx)


class FusedMoE(CpuFusedMoE):
    """``fused_moe``: on the CPU one native call per layer; elsewhere the reference.

    No Triton kernel yet: on CUDA it runs the contract's reference (what engine-core's
    built-in runs), so building it there needs no triton.
    """

    name: ClassVar[str] = "fused_moe"


__all__ = ["FusedMoE", "GeluAndMul", "RMSNorm", "RotaryEmbedding", "SiluAndMul"]
