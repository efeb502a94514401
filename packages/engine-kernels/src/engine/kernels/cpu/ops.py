"""The CPU paths of the built-in custom ops, in C++: engine-kernels' ``engine.custom_ops``.

``rms_norm``, ``rotary_embedding``, ``silu_and_mul`` and ``gelu_and_mul`` implementations
that the engine
chooses on the CPU as it would a third party's (measured, or ranked: engine-core's own
entries are the contracts' references and have no CPU path of their own). Each subclasses
its contract in ``engine.sdk.ops`` and overrides only ``forward_cpu``, so the reference
(``forward_native``) and every other device's path stay the contract's.

``forward_cpu`` runs the engine's CPU kernels (``engine.kernels.cpu.native``, ``elementwise.cpp``):
one pass over the data instead of torch's four to six elementwise ops, RMSNorm and
rotation in place (the contracts allow it). Where a call is outside what the kernels take
(float32 or bfloat16; 2-D rows with a contiguous last axis, for ``rms_norm`` any
``[..., n]`` that views as ``[-1, n]`` rows, e.g. per-head ``[tokens, heads, head_size]``;
the weight or the cos/sin cache in the kernel's dtype; no autograd graph to record) or
the kernels cannot be built here (no C++ compiler; ``is_supported`` then says why and the
engine keeps the built-in reference), it runs the reference, so results never depend on
whether a compiler is installed beyond float32 rounding order.

Each declares that a graph may record it (``capture_support``, ``engine.sdk.capture``):
the CPU step graph where it runs its ``forward_cpu``, CUDA graphs where it runs the
contract's reference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from engine.kernels.cpu.native import load, native_kernels
from engine.kernels.cpu.native.library import DTYPE_CODES, NativeBuildError, NativeKernels
from engine.sdk.capture import CaptureContext, GraphKind
from engine.sdk.ops import CustomOp, GeluAndMulOp, RMSNormOp, RotaryEmbeddingOp, SiluAndMulOp
from engine.sdk.platform import PlatformInfo
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


def _is_supported(cls: type[CustomOp], platform: PlatformInfo) -> Support:
    """The contract's answer (a CPU path of its own), and the kernels must build here."""
    answer: Support = CustomOp.is_supported.__func__(cls, platform)  # type: ignore[attr-defined]
    if answer.ok and platform.device_type == "cpu":
        try:
            load()
        except NativeBuildError as exc:
            return Support.no(f"the engine's CPU kernels are unavailable: {exc}")
    return answer


def _capture_support(op: CustomOp, ctx: CaptureContext, cpu: Callable[..., Any],
                     contract: type[CustomOp]) -> Support:
    """An op's answer: what it runs must be its own CPU kernel or the reference.

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


class CpuRMSNorm(RMSNormOp):
    """``rms_norm``: the contract, with the CPU path in one fused in-place kernel."""

    name: ClassVar[str] = "rms_norm"

    @classmethod
    def is_supported(cls, platform: PlatformInfo) -> Support:
        return _is_supported(cls, platform)

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
        return _capture_support(self, ctx, CpuRMSNorm.forward_cpu, RMSNormOp)


class CpuRotaryEmbedding(RotaryEmbeddingOp):
    """``rotary_embedding``: the contract, rotating in place on the CPU in one kernel."""

    name: ClassVar[str] = "rotary_embedding"

    @classmethod
    def is_supported(cls, platform: PlatformInfo) -> Support:
        return _is_supported(cls, platform)

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
        return _capture_support(self, ctx, CpuRotaryEmbedding.forward_cpu, RotaryEmbeddingOp)


class CpuSiluAndMul(SiluAndMulOp):
    """``silu_and_mul``: the contract, with the CPU path in one kernel."""

    name: ClassVar[str] = "silu_and_mul"

    @classmethod
    def is_supported(cls, platform: PlatformInfo) -> Support:
        return _is_supported(cls, platform)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        return _gated(self, x, lambda kernels, rows, out: kernels.silu_and_mul(rows, out))

    def capture_support(self, ctx: CaptureContext) -> Support:
        return _capture_support(self, ctx, CpuSiluAndMul.forward_cpu, SiluAndMulOp)


class CpuGeluAndMul(GeluAndMulOp):
    """``gelu_and_mul``: the contract, with the CPU path in one kernel (erf or tanh form).

    The kernel's erf and tanh are accurate to about an ulp (``vmath.h``), torch's erf to
    about 1.5e-7: float32 results agree to a few ulp of ``gelu``'s magnitude, bfloat16 ones
    bit for bit but where the float32 GELU falls within that of a rounding tie.
    """

    name: ClassVar[str] = "gelu_and_mul"

    @classmethod
    def is_supported(cls, platform: PlatformInfo) -> Support:
        return _is_supported(cls, platform)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        return _gated(self, x, lambda kernels, rows, out: kernels.gelu_and_mul(
            rows, out, self.approximate))

    def capture_support(self, ctx: CaptureContext) -> Support:
        return _capture_support(self, ctx, CpuGeluAndMul.forward_cpu, GeluAndMulOp)




def _gated(op: SiluAndMulOp | GeluAndMulOp, x: torch.Tensor,
           call: Callable[[NativeKernels, torch.Tensor, torch.Tensor], None]) -> torch.Tensor:
    """A gated activation ``act(x[..., :d]) * x[..., d:]`` by ``call(kernels, rows, out)``.

    ``rows`` is ``x`` as ``[rows, 2d]``, ``out`` the ``[rows, d]`` result; the op's
    reference runs where the kernel cannot (no library, odd width, rows it cannot read,
    autograd recording).
    """
    kernels = native_kernels()
    width = x.shape[-1] if x.dim() else 1
    rows = x.reshape(-1, width) if x.dim() else x
    if kernels is None or width % 2 or not _rows(rows) or _recording(x):
        return op.forward_native(x)
    out = x.new_empty((*x.shape[:-1], width // 2))
    call(kernels, rows, out.view(-1, width // 2))
    return out


__all__ = ["CpuGeluAndMul", "CpuRMSNorm", "CpuRotaryEmbedding", "CpuSiluAndMul"]
