"""The reference linear kernel for unquantized weights: ``torch`` in ``engine.linear_kernels``.

``torch`` (priority 0): ``torch.nn.functional.linear`` on the dense weight; runs on every
device and dtype torch has. It is what a layer uses when no faster kernel is installed or
eligible, and what hand-built layer factories use (``default_kernel_selector``). The CPU's
faster kernels (``cpu``, ``onednn``) are engine-kernels' (``engine.kernels.cpu.linear``),
chosen through the same selection as a third party's: ``--linear-kernel NAME`` forces
one, ``--disabled-kernels`` removes some.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from engine.sdk.capture import CaptureContext, GraphKind
from engine.sdk.linear_kernel import LinearKernel, LinearKernelConfig
from engine.sdk.platform import PlatformInfo
from engine.sdk.support import Support

DTYPES = ("float32", "bfloat16", "float16")


class TorchLinearKernel(LinearKernel):
    """``F.linear`` on the dense weight."""

    name: ClassVar[str] = "torch"
    priority: ClassVar[int] = 0

    @classmethod
    def is_supported(cls, platform: PlatformInfo) -> Support:
        return Support.yes()

    @classmethod
    def can_implement(cls, config: LinearKernelConfig) -> Support:
        if config.scheme != "unquantized":
            return Support.no(f"scheme {config.scheme} is not unquantized")
        if config.weight_dtype not in DTYPES or config.act_dtype != config.weight_dtype:
            return Support.no(f"weight/activation dtype {config.weight_dtype}/{config.act_dtype} "
                              f"not supported; supported: {', '.join(DTYPES)} (same for both)")
        return Support.yes()

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        weight: torch.Tensor = layer.weight  # type: ignore[assignment]
        return F.linear(x, weight, bias)

    def capture_support(self, ctx: CaptureContext) -> Support:
        if ctx.kind is GraphKind.CUDA_GRAPHS:
            return Support.yes()
        return Support.no("F.linear is a torch product, which the CPU step graph cannot "
                          "replay")


__all__ = ["TorchLinearKernel"]
