"""The CPU's linear kernels for unquantized weights (engine-kernels' ``engine.linear_kernels``).

Beside them, engine-core's ``torch`` (priority 0, ``F.linear``) runs everywhere.

* ``onednn`` (priority 100, CPU, float32, and bfloat16 where oneDNN has a bfloat16 matmul
  for the CPU: avx512bw/vl/dq or avx_ne_convert): the CPU's oneDNN with the weight
  reordered once into its blocked layout for the CPU (``mkldnn._reorder_linear_weight``,
  what torch's inductor does), applied with ``mkldnn._linear_pointwise``. On the
  benchmark model's shapes with the weights streamed from memory (12 layers, 2 threads,
  Zen 4 with avx512_bf16): bfloat16 1.31x ``F.linear`` at 1 token and 1.22x at 64 (366
  GFLOP/s, about the matmul peak), float32 1.8x at 1 token and 1.5x at 64
  (``benchmarks/linear_kernels.py``). The layer keeps its dense weight too (inspectable,
  and what other kernels would read), at the cost of a second copy.

* ``cpu`` (priority 100, CPU, float32 with AVX-512 or AVX2 and FMA, bfloat16 with
  avx512_bf16; wins the tie with ``onednn`` by name): the engine's own C++. Products of 1
  to 3 rows (decode steps of small batches) run on the dense weight
  (``native/small_matmul.cpp``), which
  streams each weight once at the memory's speed: a batch-1 step's 49 products 1.4-1.9x
  faster than oneDNN's, whose loop for these shapes is bound by compute (~19 GB/s
  against ~30). More rows multiply a copy of the weight packed once into column panels
  (``native/packed_matmul.cpp``), kept instead of oneDNN's: 1.08-1.13x oneDNN at 64 rows
  (~400-430 GFLOP/s), ~1.3x at 4-16, 0.97-1.05x at 512-2048. On AVX2 (float32, tiles of
  16 columns, every system restricted to AVX2 on the same Zen 4) the products of a
  64-row step take 1.4x less time than oneDNN's (~210 GFLOP/s, ~95% of the core's
  register-only FMA peak). There a float32 weight whose values are all bfloat16 values
  (a bfloat16 checkpoint run in float32, as ``--dtype auto`` does on such CPUs) is
  packed as bfloat16 and widened back in the loop (the float32 panels' sums bit for bit,
  from half the bytes); these panels serve every row count, 1-3 rows included (2.5x the
  float32 panels and ~1.9x the dense loop at 1 row, 1.05x the float32 panels at 64),
  and the layer holds no float32 copy but its dense weight. A bfloat16 weight with an
  odd input size (no whole pairs) goes to oneDNN; where the C++ is not built (no
  compiler, another CPU), ``onednn`` is chosen instead.

Both go through the same selection as third-party kernels: ``--linear-kernel NAME`` forces
one, ``--disabled-kernels`` removes some.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import torch
import torch.nn.functional as F

from engine.kernels.cpu.native import native_kernels
from engine.kernels.cpu.native.library import SMALL_MATMUL_ROWS
from engine.sdk.capture import CaptureContext, GraphKind
from engine.sdk.linear_kernel import LinearKernel, LinearKernelConfig
from engine.sdk.platform import PlatformInfo
from engine.sdk.support import Support

UNQUANTIZED = "unquantized"


def _unquantized(config: LinearKernelConfig, dtypes: tuple[str, ...]) -> Support:
    if config.scheme != UNQUANTIZED:
        return Support.no(f"scheme {config.scheme} is not {UNQUANTIZED}")
    if config.weight_dtype not in dtypes or config.act_dtype != config.weight_dtype:
        return Support.no(f"weight/activation dtype {config.weight_dtype}/{config.act_dtype} "
                          f"not supported; supported: {', '.join(dtypes)} (same for both)")
    return Support.yes()


class OneDNNLinearKernel(LinearKernel):
    """oneDNN matmul on a weight reordered once into oneDNN's blocked layout (CPU)."""

    name: ClassVar[str] = "onednn"
    priority: ClassVar[int] = 100

    def __init__(self, config: LinearKernelConfig) -> None:
        super().__init__(config)
        self.packed: torch.Tensor | None = None

    @classmethod
    def is_supported(cls, platform: PlatformInfo) -> Support:
        if platform.device_type != "cpu":
            return Support.no(f"runs on the CPU only, not {platform.device_type}")
        if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
            return Support.no("this torch build has no oneDNN (torch.backends.mkldnn)")
        return Support.yes()

    @classmethod
    def can_implement(cls, config: LinearKernelConfig) -> Support:
        if config.weight_dtype == "bfloat16" and not onednn_has_bfloat16():
            return Support.no("oneDNN has no bfloat16 matmul for this CPU (it needs avx512bw, "
                              "avx512vl and avx512dq, or avx_ne_convert); supported here: "
                              "float32")
        return _unquantized(config, ("float32", "bfloat16"))

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        weight: torch.Tensor = layer.weight  # type: ignore[assignment]
        # The layout oneDNN picks for a batch of this many rows; any row count runs on it.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.packed is None:
            raise RuntimeError("onednn linear kernel used before process_weights_after_loading")
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(flat, self.packed, bias, "none",
                                                               [], "")
        return out.view(*x.shape[:-1], out.shape[-1])

    def capture_support(self, ctx: CaptureContext) -> Support:
        return Support.no("oneDNN's product is not a native kernel a graph can replay")


class CpuLinearKernel(OneDNNLinearKernel):
    """The engine's C++ products (dense rows for 1-3 rows, column panels above; see above)."""

    name: ClassVar[str] = "cpu"
    priority: ClassVar[int] = 100

    def __init__(self, config: LinearKernelConfig) -> None:
        super().__init__(config)
        self.panels: torch.Tensor | None = None

    @classmethod
    def is_supported(cls, platform: PlatformInfo) -> Support:
        answer = super().is_supported(platform)
        if answer.ok and native_kernels() is None:
            return Support.no("the engine's CPU kernels could not be built here (see the "
                              "cpu attention backend's reason); onednn serves instead")
        return answer

    @classmethod
    def can_implement(cls, config: LinearKernelConfig) -> Support:
        # Not oneDNN's answer: its fallbacks here (an odd K in bfloat16) exist wherever the
        # C++ has a bfloat16 kernel (avx512_bf16 implies oneDNN's bfloat16 instructions).
        answer = _unquantized(config, ("float32", "bfloat16"))
        kernels = native_kernels()
        if answer.ok and kernels is not None and getattr(
                torch, config.weight_dtype) not in kernels.small_matmul_dtypes:
            supported = ", ".join(sorted(str(d).removeprefix("torch.")
                                         for d in kernels.small_matmul_dtypes)) or "none"
            return Support.no(f"no small-batch kernel for {config.weight_dtype} on this CPU "
                              f"(float32 needs AVX-512 or AVX2 and FMA, bfloat16 avx512_bf16); "
                              f"supported here: {supported}")
        return answer

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        weight: torch.Tensor = layer.weight  # type: ignore[assignment]
        kernels = native_kernels()
        self.panels = self.packed = None
        if kernels is not None and _packable(kernels.packed_matmul_dtypes, weight):
            if weight.dtype == torch.float32 and kernels.packs_float32_as_bfloat16:
                self.panels = kernels.pack_matmul_weight(weight.detach(), as_bfloat16=True)
            if self.panels is None:  # not that build, or not all bfloat16 values
                self.panels = kernels.pack_matmul_weight(weight.detach())
        else:  # bfloat16 with an odd K, a build without the packed kernel: oneDNN
            super().process_weights_after_loading(layer)

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        kernels = native_kernels()
        weight: torch.Tensor = layer.weight  # type: ignore[assignment]
        small = 0 < rows <= SMALL_MATMUL_ROWS
        if kernels is None or rows == 0 or not (small or self.panels is not None) or (
                torch.is_grad_enabled() and x.requires_grad):
            return super().apply(layer, x, bias) if self.packed is not None else F.linear(
                x, weight, bias)
        flat = x.reshape(rows, x.shape[-1])
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        n = weight.shape[0]
        out = torch.empty(rows, n, dtype=x.dtype)
        kernels.matmul(flat, weight, self.panels, bias, out)  # small rows or panels: in C
        return out.view(*x.shape[:-1], n)

    def capture_support(self, ctx: CaptureContext) -> Support:
        """The CPU step graph, where the weight is packed: every row count runs in C."""
        if ctx.kind is not GraphKind.CPU_STEP_GRAPH:
            return Support.no(f"it runs on the CPU only, not in {ctx.kind.value}")
        if self.panels is None:
            return Support.no("its weight is not packed here (oneDNN multiplies 4+ rows)")
        return Support.yes()


@functools.cache
def onednn_has_bfloat16() -> bool:
    """Whether oneDNN multiplies bfloat16 on this CPU (torch asks oneDNN's CPU checks)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _packable(dtypes: frozenset[torch.dtype], weight: torch.Tensor) -> bool:
    """Whether ``packed_matmul`` takes this weight (oneDNN takes any other).

    Its dtype built here, a contiguous CPU tensor (``pack_matmul_weight`` reads it flat),
    and for bfloat16 whole pairs along K.
    """
    return weight.dtype in dtypes and weight.is_cpu and weight.is_contiguous() and not (
        weight.dtype == torch.bfloat16 and weight.shape[1] % 2)


#: Row count the packed layout is chosen for (64: float32 1.15x faster at 64 rows than
#: packing for 1, and within 8% at 1 row; bfloat16 the same either way).
PACK_ROWS = 64


__all__ = ["CpuLinearKernel", "OneDNNLinearKernel", "onednn_has_bfloat16"]
