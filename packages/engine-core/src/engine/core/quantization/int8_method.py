"""``int8``: online W8A8 quantization of an unquantized (bf16/fp16/fp32) checkpoint.

Selected by ``--quantization int8``. Each linear layer (not the embedding, not the LM
head) loads its float weight as usual, then quantizes it once, per output channel and
symmetric::

    weight_scale[o] = max_i |W[o, i]| / 127            (float32)
    weight[o, i]    = round(W[o, i] / weight_scale[o])  (int8, in [-127, 127])

At run time the activations are quantized per token the same way (``int8_w8a8`` kernels,
``int8_kernels.py``), so the matmul is an int8 x int8 -> int32 product (the CPU's VNNI /
AMX dot-product instructions through oneDNN) rescaled by ``x_scale[t] * weight_scale[o]``.

Settings (``quantization_config`` in ``config.json``, or none with ``--quantization``)::

    {"quant_method": "int8", "modules_to_not_convert": ["mlp.down_proj"]}

Under tensor parallelism each rank quantizes its own shard (row-parallel shards get the
scale of their part of each row).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from engine.sdk.capture import CaptureContext
from engine.sdk.errors import ValidationError
from engine.sdk.linear_kernel import LinearKernel, LinearKernelConfig
from engine.sdk.platform import PlatformInfo
from engine.sdk.quantization import LayerInfo, QuantizationConfig, QuantizeMethod
from engine.sdk.support import Support

SCHEME = "int8_w8a8"
INT8_MAX = 127


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: ``(q int8, scale float32)`` with ``W ~= q * scale[:, None]``."""
    w = weight.float()
    scale = w.abs().amax(dim=-1).clamp(min=1e-12) / INT8_MAX
    q = torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


class Int8LinearMethod(QuantizeMethod):
    """Float weight loaded, then int8 + per-channel scale; the matmul is an int8 kernel."""

    def __init__(self) -> None:
        self.kernel: LinearKernel | None = None

    def create_weights(self, layer: nn.Module, info: LayerInfo) -> None:
        weight = nn.Parameter(torch.empty(info.output_size_per_partition,
                                          info.input_size_per_partition,
                                          dtype=getattr(torch, info.params_dtype)),
                              requires_grad=False)
        weight.output_dim = 0  # type: ignore[attr-defined]
        weight.input_dim = 1  # type: ignore[attr-defined]
        layer.register_parameter("weight", weight)
        config = LinearKernelConfig(
            scheme=SCHEME, weight_dtype="int8", act_dtype=info.params_dtype,
            input_size=info.input_size_per_partition,
            output_size=info.output_size_per_partition, has_bias=info.has_bias)
        self.kernel = info.linear_kernel_selector(config)(config)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"int8: the layer has no 'weight' tensor, got {weight!r}")
        q, scale = quantize_per_channel(weight.detach())
        layer.register_parameter("weight", nn.Parameter(q, requires_grad=False))
        layer.register_parameter("weight_scale", nn.Parameter(scale, requires_grad=False))
        self._kernel().process_weights_after_loading(layer)

    def _kernel(self) -> LinearKernel:
        if self.kernel is None:
            raise RuntimeError("int8: apply before create_weights")
        return self.kernel

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._kernel().apply(layer, x, bias)

    def capture_support(self, ctx: CaptureContext) -> Support:
        """Yes: ``apply`` only calls the kernel, which the engine asks itself."""
        return Support.yes()


class Int8Config(QuantizationConfig):
    """The ``int8`` method (see the module docstring)."""

    name: ClassVar[str] = "int8"
    KEYS: ClassVar[tuple[str, ...]] = ("quant_method", "modules_to_not_convert")

    def __init__(self, modules_to_not_convert: tuple[str, ...] = ()) -> None:
        self.modules_to_not_convert = modules_to_not_convert

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Int8Config:
        method = config.get("quant_method", cls.name)
        if method != cls.name:
            raise ValidationError(
                f"int8 quantizes an unquantized checkpoint when it loads, but this checkpoint "
                f"is quantized with {method!r}; drop --quantization to load it with its own "
                f"method", param="quant_method")
        unknown = sorted(set(config) - set(cls.KEYS))
        if unknown:
            raise ValidationError(f"unknown int8 setting(s) {', '.join(unknown)}; allowed: "
                                  f"{', '.join(cls.KEYS)}", param=unknown[0])
        skip = config.get("modules_to_not_convert", [])
        if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
            raise ValidationError(f"modules_to_not_convert must be a list of strings, got "
                                  f"{skip!r}", param="modules_to_not_convert")
        return cls(tuple(skip))

    @classmethod
    def supported_act_dtypes(cls) -> list[str]:
        return ["bfloat16", "float16", "float32"]

    @classmethod
    def is_supported(cls, platform: PlatformInfo) -> Support:
        if platform.device_type not in ("cpu", "cuda"):
            return Support.no(f"runs on cpu and cuda only, found {platform.device_type}")
        return Support.yes()

    def get_quant_method(self, layer: LayerInfo, prefix: str) -> QuantizeMethod | None:
        if layer.kind != "linear" or any(s in prefix for s in self.modules_to_not_convert):
            return None
        return Int8LinearMethod()
