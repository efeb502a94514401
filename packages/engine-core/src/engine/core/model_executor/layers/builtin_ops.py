"""The engine's built-in custom ops: the SDK's contracts, run as their references.

A model's ``rms_norm``, ``rotary_embedding``, ``silu_and_mul``, ``gelu_and_mul`` and
``fused_moe`` are built from the implementation ``engine.core.custom_op_selection`` chooses
among every installed one; these classes are engine-core's entries and the fallback: each
is its contract in ``engine.sdk.ops`` unchanged, so it runs ``forward_native`` (torch ops)
on every device. The fast paths are other distributions' entries of the same names, chosen
beside any third party's: engine-kernels' CPU kernels (``engine.kernels.cpu.ops``) and
Triton kernels (``engine.kernels.ops``). ``--custom-ops -NAME`` (or ``none``) builds these.

Each declares that CUDA graphs may record it (``capture_support``, ``engine.sdk.capture``):
the reference is torch ops a CUDA graph captures; the CPU step graph records native calls
only, so it refuses these (the model then runs eagerly, saying so). ``fused_moe`` refuses
both: its reference sizes each expert's product by the tokens routed to it, which the host
reads from the device (neither graph kind can record a data-dependent shape).

``fused_moe``'s reference is the grouped computation (the tokens of each expert gathered
with argsort/bincount, one product pair per expert over only its tokens, the weighted rows
summed with ``index_add_``). On the CPU engine-kernels' ``fused_moe`` runs the same in one
native call per layer (routing, grouping and every expert's products in C++), which the
CPU step graph records; on a GPU a kernel would do all experts in one grouped GEMM launch
over block-aligned token groups (vLLM's ``fused_moe`` Triton kernel), which would also
make it recordable by CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from engine.sdk.capture import CaptureContext, GraphKind
from engine.sdk.ops import (
    CustomOp,
    FusedMoEOp,
    GeluAndMulOp,
    RMSNormOp,
    RotaryEmbeddingOp,
    SiluAndMulOp,
)
from engine.sdk.support import Support


def _capture_support(op: CustomOp, ctx: CaptureContext) -> Support:
    """A built-in op's answer: CUDA graphs capture the reference; the CPU step graph cannot."""
    if ctx.kind is GraphKind.CUDA_GRAPHS:
        return Support.yes()
    return Support.no(f"{type(op).__qualname__} runs the contract's reference (torch ops), "
                      f"which a CPU step graph cannot record")


class RMSNorm(RMSNormOp):
    """``rms_norm``: the contract's reference."""

    name: ClassVar[str] = "rms_norm"

    def capture_support(self, ctx: CaptureContext) -> Support:
        return _capture_support(self, ctx)


class RotaryEmbedding(RotaryEmbeddingOp):
    """``rotary_embedding``: the contract's reference."""

    name: ClassVar[str] = "rotary_embedding"

    def capture_support(self, ctx: CaptureContext) -> Support:
        return _capture_support(self, ctx)


class SiluAndMul(SiluAndMulOp):
    """``silu_and_mul``: the contract's reference."""

    name: ClassVar[str] = "silu_and_mul"

    def capture_support(self, ctx: CaptureContext) -> Support:
        return _capture_support(self, ctx)


class GeluAndMul(GeluAndMulOp):
    """``gelu_and_mul``: the contract's reference."""

    name: ClassVar[str] = "gelu_and_mul"

    def capture_support(self, ctx: CaptureContext) -> Support:
        return _capture_support(self, ctx)


class FusedMoE(FusedMoEOp):
    """``fused_moe``: the contract's reference, grouped by expert (the CPU path too)."""

    name: ClassVar[str] = "fused_moe"

    def capture_support(self, ctx: CaptureContext) -> Support:
        return Support.no(f"{type(self).__qualname__} runs the contract's reference, whose "
                          f"per-expert products take their sizes from the routing (read "
                          f"back to the host each step), which no graph can record")


#: The class each built-in op is built from when no other implementation is chosen.
BUILTIN_IMPLEMENTATIONS: Mapping[str, type[CustomOp]] = {
    op.name: op for op in (RMSNorm, RotaryEmbedding, SiluAndMul, GeluAndMul, FusedMoE)
}

__all__ = ["BUILTIN_IMPLEMENTATIONS", "FusedMoE", "GeluAndMul", "RMSNorm", "RotaryEmbedding",
           "SiluAndMul"]
