"""Linear-kernel plugin: ``x @ W^T + b`` for unquantized weights, as a last resort.

Priority -10: below every built-in, so it is only used when forced with
``--linear-kernel sdk1_matmul`` (or when nothing else fits). It keeps a transposed,
contiguous copy of the weight and runs one ``torch.matmul``.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from engine.sdk import LinearKernel, LinearKernelConfig, PlatformInfo, Support
from engine_test_plugin_sdk1.counters import count

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


class Sdk1MatmulKernel(LinearKernel):
    name: ClassVar[str] = "sdk1_matmul"
    priority: ClassVar[int] = -10

    def __init__(self, config: LinearKernelConfig) -> None:
        super().__init__(config)
        self.weight_t: torch.Tensor | None = None

    @classmethod
    def is_supported(cls, platform: PlatformInfo) -> Support:
        count("sdk1_matmul.is_supported")
        if platform.device_type not in ("cpu", "cuda"):
            return Support.no(f"runs on cpu and cuda only, found {platform.device_type}")
        return Support.yes()

    @classmethod
    def can_implement(cls, config: LinearKernelConfig) -> Support:
        count("sdk1_matmul.can_implement")
        if config.scheme != "unquantized":
            return Support.no(f"scheme {config.scheme} is not unquantized")
        if config.weight_dtype not in SUPPORTED_DTYPES or config.act_dtype != config.weight_dtype:
            return Support.no(f"weight/activation dtype {config.weight_dtype}/{config.act_dtype} "
                              f"not supported; supported: {', '.join(SUPPORTED_DTYPES)} (same "
                              f"for both)")
        if config.group_size is not None:
            return Support.no(f"group_size {config.group_size}: unquantized weights have none")
        if config.zero_point:
            return Support.no("zero points are not supported")
        return Support.yes()

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        count("sdk1_matmul.process_weights_after_loading")
        weight = layer.weight
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"sdk1_matmul: the layer has no 'weight' tensor, got {weight!r}")
        self.weight_t = weight.detach().t().contiguous()

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        count("sdk1_matmul.apply")
        if self.weight_t is None:
            raise RuntimeError("sdk1_matmul used before process_weights_after_loading")
        out = torch.matmul(x, self.weight_t)
        return out if bias is None else out + bias
