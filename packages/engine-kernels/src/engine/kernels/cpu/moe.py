"""``fused_moe`` on the CPU in one native call per layer (engine-kernels' ``engine.custom_ops``).

The SDK's reference (``FusedMoEOp.forward_native``) groups the tokens by expert in torch:
argsort, bincount read back to the host, then a Python loop with two products per active
expert. Here ``forward_cpu`` is one call into the engine's CPU kernels
(``native/fused_moe.cpp``): softmax, top-k (ties as ``torch.topk``) and renormalisation,
the tokens grouped by expert, each active expert's gate/up product, gated activation and
down product over only its tokens (the ``cpu`` linear kernel's products, every expert's
column chunks one OpenMP team's work), and the weighted sum in float32 in the reference's
order. The contract's options are the call's too (``FusedMoEOp.extra_options``): GPT-OSS's
clamped SwiGLU (``activation="swigluoai"`` with its alpha and limit) and the experts'
biases (``bias=True``: each added in its product, before the rounding).
The routing's sizes stay inside the call, so the CPU step graph records it as one call
(``capture_support``): a MoE model's decode step replays in C like a dense one's.

The weights are packed once after loading (``process_weights_after_loading``, which the
engine's model loader calls on every module; else on the first call): per expert, the
gate and up halves of ``w13`` and ``w2`` into ``pack_matmul_weight``'s column panels, as
the ``cpu`` linear kernel packs a dense layer's weight (float32 weights holding only
bfloat16 values as bfloat16 on AVX2 builds), kept as non-persistent buffers so a graph may
point at them. The dense ``w13``/``w2`` stay (the reference and 1-3-token products read
them). Where the kernels cannot take a call (another dtype, no packed kernel for it on
this CPU, autograd recording), it runs the reference; so does an instance with an option
the native call does not implement (an ``extra_options`` key outside ``IMPLEMENTED``, an
activation outside ``FUSED_MOE_ACTIVATIONS``), which then neither packs its weights nor
is recorded.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from engine.kernels.cpu.native import native_kernels
from engine.kernels.cpu.native.library import FUSED_MOE_ACTIVATIONS, NativeKernels
from engine.kernels.cpu.ops import _capture_support, _is_supported, _recording
from engine.sdk.capture import CaptureContext
from engine.sdk.ops import FusedMoEOp
from engine.sdk.platform import PlatformInfo
from engine.sdk.support import Support

#: The buffers ``process_weights_after_loading`` adds: the panels of the gate halves, the
#: up halves and ``w2``, each ``[E, packed size]``.
PANEL_NAMES = ("gate_panels", "up_panels", "down_panels")
#: The ``FusedMoEOp.extra_options`` keys the native call implements.
IMPLEMENTED = frozenset({"activation", "swiglu_alpha", "swiglu_limit", "bias"})


class CpuFusedMoE(FusedMoEOp):
    """``fused_moe``: the contract, with the CPU path in one native call (see above)."""

    name: ClassVar[str] = "fused_moe"

    @classmethod
    def is_supported(cls, platform: PlatformInfo) -> Support:
        return _is_supported(cls, platform)

    def process_weights_after_loading(self) -> None:
        """Pack every expert's weights into the products' panels (once, after loading)."""
        kernels = native_kernels()
        for name in PANEL_NAMES:
            self._buffers.pop(name, None)
        self._packed = True
        if kernels is None or not self.w13.is_cpu or self.unimplemented():
            return
        panels = _pack(kernels, self.w13.detach(), self.w2.detach(), self.intermediate_size)
        if panels is not None:
            for name, tensor in zip(PANEL_NAMES, panels, strict=True):
                self.register_buffer(name, tensor, persistent=False)

    def unimplemented(self) -> list[str]:
        """The options this instance sets that the native call lacks (sorted; [] if none)."""
        missing = set(self.extra_options()) - IMPLEMENTED
        if self.activation not in FUSED_MOE_ACTIVATIONS:
            missing.add(f"activation {self.activation!r}")
        return sorted(missing)

    def biases(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(w13_bias, w2_bias)`` as the native call reads them, or None without biases."""
        if self.w13_bias is None or self.w2_bias is None:
            return None
        return self.w13_bias.detach(), self.w2_bias.detach()

    def panels(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The packed weights (None: not packable here; packed on first use)."""
        if not getattr(self, "_packed", False):
            self.process_weights_after_loading()
        found = [self._buffers.get(name) for name in PANEL_NAMES]
        if any(t is None for t in found):
            return None
        gate, up, down = found
        assert gate is not None and up is not None and down is not None
        return gate, up, down

    def forward_cpu(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        kernels = native_kernels()
        panels = None if kernels is None else self.panels()
        biases = self.biases()
        if (kernels is None or panels is None or hidden.dim() != 2 or hidden.stride(1) != 1
                or hidden.dtype != self.w13.dtype or router_logits.dim() != 2
                or router_logits.stride(1) != 1
                or router_logits.dtype not in (torch.float32, torch.bfloat16)
                or _recording(hidden, router_logits, self.w13, self.w2, *(biases or ()))
                or (biases is not None and not all(
                    b.is_contiguous() and b.dtype == hidden.dtype for b in biases))):
            return self.forward_native(hidden, router_logits)
        out = hidden.new_empty(hidden.shape)
        if hidden.shape[0]:
            kernels.fused_moe(hidden, router_logits, self.top_k, self.renormalize, self.w13,
                              self.w2, panels, out, activation=self.activation,
                              swiglu_alpha=self.swiglu_alpha, swiglu_limit=self.swiglu_limit,
                              biases=biases)
        return out

    def capture_support(self, ctx: CaptureContext) -> Support:
        """The CPU step graph where it runs its native call (its weights packed here)."""
        answer = _capture_support(self, ctx, CpuFusedMoE.forward_cpu, FusedMoEOp)
        unsupported = ", ".join(self.unimplemented())
        if answer.ok and unsupported:
            return Support.no(f"its native call does not implement the experts' {unsupported} "
                              f"(it runs the reference, whose sizes come from the routing)")
        if answer.ok and self.panels() is None:
            return Support.no(f"its {self.w13.dtype} weights cannot be packed on this CPU "
                              f"(it runs the reference, whose sizes come from the routing)")
        if not answer.ok and self.dispatch_key == "cuda":
            return Support.no("on CUDA it runs the reference, whose per-expert products take "
                              "their sizes from the routing (read back to the host)")
        return answer


def _pack(kernels: NativeKernels, w13: torch.Tensor, w2: torch.Tensor, size: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Each expert's gate half, up half and ``w2`` packed, stacked; None if not packable.

    float32 weights that are all bfloat16 values are packed as bfloat16 where the build
    widens them (as the ``cpu`` linear kernel does), all three or none.
    """
    dtype = w13.dtype
    if dtype not in kernels.packed_matmul_dtypes or not (w13.is_contiguous()
                                                         and w2.is_contiguous()):
        return None
    if dtype == torch.bfloat16 and (w13.shape[2] % 2 or w2.shape[2] % 2):
        return None  # bfloat16 panels take pairs along K
    halves = [[w[:size] for w in w13], [w[size:] for w in w13], list(w2)]
    if dtype == torch.float32 and kernels.packs_float32_as_bfloat16:
        widened = [[kernels.pack_matmul_weight(w.contiguous(), as_bfloat16=True) for w in part]
                   for part in halves]
        if all(p is not None for part in widened for p in part):
            return _stacked(widened)
    return _stacked([[kernels.pack_matmul_weight(w.contiguous()) for w in part]
                     for part in halves])


def _stacked(parts: list[list[torch.Tensor | None]]
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gate, up, down = (torch.stack([p for p in part if p is not None]) for part in parts)
    return gate, up, down


__all__ = ["IMPLEMENTED", "PANEL_NAMES", "CpuFusedMoE"]
