"""``test_quant_fp16_matmul``: the linear kernel of scheme ``test_fp16_weights``."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from engine.sdk import LinearKernel, LinearKernelConfig, PlatformInfo, Support
from engine_test_plugin_quant.counters import count

SCHEME = "test_fp16_weights"


class HalfWeightKernel(LinearKernel):
    name: ClassVar[str] = "test_quant_fp16_matmul"
    priority: ClassVar[int] = 50

    @classmethod
    def is_supported(cls, platform: PlatformInfo) -> Support:
        return Support.yes()

    @classmethod
    def can_implement(cls, config: LinearKernelConfig) -> Support:
        count("test_quant_fp16_matmul.can_implement")
        if config.scheme != SCHEME:
            return Support.no(f"scheme {config.scheme} is not {SCHEME}")
        if config.weight_dtype != "float16":
            return Support.no(f"weight dtype {config.weight_dtype} is not float16")
        return Support.yes()

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        count("test_quant_fp16_matmul.process_weights_after_loading")

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        count("test_quant_fp16_matmul.apply")
        weight: torch.Tensor = layer.weight  # type: ignore[assignment]
        return F.linear(x, weight.to(x.dtype), bias)
