"""``test_quant_fp16``: linear weights stored in float16, multiplied by a linear kernel."""

from __future__ import annotations

import os
from typing import Any, ClassVar

import torch

from engine.sdk import (
    LayerInfo,
    LinearKernel,
    LinearKernelConfig,
    PlatformInfo,
    QuantizationConfig,
    QuantizeMethod,
    Support,
    ValidationError,
)
from engine_test_plugin_quant.counters import count, log
from engine_test_plugin_quant.kernel import SCHEME

NAME = "test_quant_fp16"


class HalfWeightMethod(QuantizeMethod):
    def __init__(self) -> None:
        self.kernel: LinearKernel | None = None

    def create_weights(self, layer: torch.nn.Module, info: LayerInfo) -> None:
        count(f"{NAME}.create_weights")
        shape = (info.output_size_per_partition, info.input_size_per_partition)
        log({"prefix": info.prefix, "tp_rank": info.tp_rank, "tp_size": info.tp_size,
             "parallel": info.parallel, "shape": list(shape)})
        weight = torch.nn.Parameter(torch.empty(shape, dtype=torch.float16), requires_grad=False)
        weight.output_dim = 0  # type: ignore[attr-defined]
        weight.input_dim = 1  # type: ignore[attr-defined]
        layer.register_parameter("weight", weight)
        config = LinearKernelConfig(scheme=SCHEME, weight_dtype="float16",
                                    act_dtype=info.params_dtype, input_size=shape[1],
                                    output_size=shape[0], has_bias=info.has_bias)
        self.kernel = info.linear_kernel_selector(config)(config)

    def _kernel(self) -> LinearKernel:
        if self.kernel is None:
            raise RuntimeError(f"{NAME}: used before create_weights")
        return self.kernel

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        count(f"{NAME}.process_weights_after_loading")
        self._kernel().process_weights_after_loading(layer)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        count(f"{NAME}.apply")
        return self._kernel().apply(layer, x, bias)


class HalfWeightConfig(QuantizationConfig):
    name: ClassVar[str] = NAME

    def __init__(self, skip: tuple[str, ...]) -> None:
        self.skip = skip

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> HalfWeightConfig:
        count(f"{NAME}.from_config")
        method = config.get("quant_method", NAME)
        if method != NAME:
            raise ValidationError(f"quant_method must be {NAME!r}, got {method!r}",
                                  param="quant_method")
        skip = config.get("skip", [])
        if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
            raise ValidationError(f"skip must be a list of strings, got {skip!r}", param="skip")
        return cls(tuple(skip))

    @classmethod
    def config_filenames(cls) -> list[str]:
        return [f"{NAME}.json"]

    @classmethod
    def supported_act_dtypes(cls) -> list[str]:
        return ["float32", "bfloat16"]

    @classmethod
    def is_supported(cls, platform: PlatformInfo) -> Support:
        count(f"{NAME}.is_supported")
        if os.environ.get("ENGINE_TEST_QUANT_UNSUPPORTED"):
            return Support.no("switched off by ENGINE_TEST_QUANT_UNSUPPORTED")
        return Support.yes()

    def get_quant_method(self, layer: LayerInfo, prefix: str) -> QuantizeMethod | None:
        count(f"{NAME}.get_quant_method")
        if layer.kind != "linear" or any(s in prefix for s in self.skip):
            return None
        return HalfWeightMethod()
