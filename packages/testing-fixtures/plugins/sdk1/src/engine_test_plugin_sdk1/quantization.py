"""Quantization plugin: weights stored in int8 with one float32 scale per output row.

Online (W8A16-style) quantization: the checkpoint holds ordinary float weights; each
linear layer loads them into a float ``weight`` and, after loading, replaces it with an
int8 ``weight`` and a float32 ``weight_scale`` ``[out]`` (symmetric, ``scale =
max|row| / 127``). ``apply`` dequantizes and multiplies. Settings (``quantization_config``
or ``sdk1_quant.json``)::

    {"quant_method": "sdk1_int8", "modules_to_not_convert": ["lm_head"]}
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from engine.sdk import (
    LayerInfo,
    PlatformInfo,
    QuantizationConfig,
    QuantizeMethod,
    Support,
    ValidationError,
)
from engine_test_plugin_sdk1.counters import count

INT8_MAX = 127


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: ``(q, scale)`` with ``weight ~= q * scale[:, None]``."""
    w = weight.to(torch.float32)
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / INT8_MAX
    q = torch.round(w / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


class Sdk1Int8LinearMethod(QuantizeMethod):
    def create_weights(self, layer: torch.nn.Module, info: LayerInfo) -> None:
        count("sdk1_int8.create_weights")
        dtype = getattr(torch, info.params_dtype)
        weight = torch.nn.Parameter(
            torch.empty(info.output_size_per_partition, info.input_size_per_partition,
                        dtype=dtype), requires_grad=False)
        weight.output_dim = 0  # type: ignore[attr-defined]
        weight.input_dim = 1  # type: ignore[attr-defined]
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        count("sdk1_int8.process_weights_after_loading")
        weight = layer.weight
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"sdk1_int8: the layer has no 'weight' tensor, got {weight!r}")
        q, scale = quantize_rows(weight.detach())
        del layer.weight
        layer.register_parameter("weight", torch.nn.Parameter(q, requires_grad=False))
        layer.register_parameter("weight_scale", torch.nn.Parameter(scale, requires_grad=False))

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        count("sdk1_int8.apply")
        weight = layer.weight.to(torch.float32) * layer.weight_scale[:, None]
        return F.linear(x, weight.to(x.dtype), bias)


class Sdk1Int8Config(QuantizationConfig):
    name: ClassVar[str] = "sdk1_int8"

    def __init__(self, modules_to_not_convert: tuple[str, ...] = ()) -> None:
        self.modules_to_not_convert = modules_to_not_convert

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Sdk1Int8Config:
        count("sdk1_int8.from_config")
        method = config.get("quant_method", cls.name)
        if method != cls.name:
            raise ValidationError(f"quant_method must be {cls.name!r}, got {method!r}",
                                  param="quant_method")
        skip = config.get("modules_to_not_convert", [])
        if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
            raise ValidationError(
                f"modules_to_not_convert must be a list of strings, got {skip!r}",
                param="modules_to_not_convert")
        unknown = sorted(set(config) - {"quant_method", "modules_to_not_convert"})
        if unknown:
            raise ValidationError(
                f"unknown {cls.name} setting(s) {', '.join(unknown)}; allowed: quant_method, "
                f"modules_to_not_convert", param=unknown[0])
        return cls(tuple(skip))

    @classmethod
    def config_filenames(cls) -> list[str]:
        return ["sdk1_quant.json"]

    @classmethod
    def supported_act_dtypes(cls) -> list[str]:
        return ["float32", "bfloat16"]

    @classmethod
    def is_supported(cls, platform: PlatformInfo) -> Support:
        if platform.device_type not in ("cpu", "cuda"):
            return Support.no(f"runs on cpu and cuda only, found {platform.device_type}")
        return Support.yes()

    def get_quant_method(self, layer: LayerInfo, prefix: str) -> QuantizeMethod | None:
        if layer.kind != "linear":
            return None  # embeddings, the LM head and kinds added later stay unquantized
        if any(skip in prefix for skip in self.modules_to_not_convert):
            return None
        return Sdk1Int8LinearMethod()
