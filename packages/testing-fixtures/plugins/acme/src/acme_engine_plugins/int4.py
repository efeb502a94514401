"""``engine.quantization`` entry ``acme_int4``: group-wise symmetric int4 weights.

A checkpoint quantized by :func:`acme_engine_plugins.int4_format.quantize_checkpoint`
stores each quantized linear layer ``P`` as

* ``P.qweight``: ``uint8 [out, in / 2]``, two 4-bit values per byte (the even input
  feature in the low nibble), each ``q + 8`` for ``q`` in ``[-8, 7]``;
* ``P.scales``: ``float32 [out, in / group_size]``, one scale per group of inputs;

and names the method in ``config.json``: ``"quantization_config": {"quant_method":
"acme_int4", "group_size": 32, "modules_to_not_convert": ["lm_head"]}`` (also read from
``acme_int4.json``). The weight is ``(q) * scale``. Embeddings and the LM head stay
unquantized. The matmul is a linear kernel of scheme ``acme_int4`` (this package's
``acme_int4_dequant``, or any faster one installed later).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.sdk.errors import UnsupportedError, ValidationError
from engine.sdk.linear_kernel import LinearKernel, LinearKernelConfig
from engine.sdk.platform import PlatformInfo
from engine.sdk.quantization import LayerInfo, QuantizationConfig, QuantizeMethod
from engine.sdk.support import Support

#: The weight scheme the kernels implement: the parameter layout above.
SCHEME = "acme_int4"


class Int4LinearMethod(QuantizeMethod):
    """One quantized linear layer: registers ``qweight`` and ``scales``; a kernel multiplies."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self.kernel: LinearKernel | None = None

    def create_weights(self, layer: torch.nn.Module, info: LayerInfo) -> None:
        out, inp = info.output_size_per_partition, info.input_size_per_partition
        if inp % self.group_size:
            raise UnsupportedError(
                f"acme_int4 cannot quantize {info.prefix}: its {inp} input features on this "
                f"rank are not whole groups of {self.group_size}",
                [("acme_int4", f"input features per rank must be a multiple of "
                               f"group_size={self.group_size}")])
        qweight = torch.nn.Parameter(torch.empty(out, inp // 2, dtype=torch.uint8),
                                     requires_grad=False)
        scales = torch.nn.Parameter(torch.empty(out, inp // self.group_size,
                                                dtype=torch.float32), requires_grad=False)
        for param in (qweight, scales):
            param.output_dim, param.input_dim = 0, 1  # type: ignore[attr-defined]
        layer.register_parameter("qweight", qweight)
        layer.register_parameter("scales", scales)
        config = LinearKernelConfig(scheme=SCHEME, weight_dtype="int4",
                                    act_dtype=info.params_dtype, input_size=inp,
                                    output_size=out, group_size=self.group_size,
                                    has_bias=info.has_bias)
        self.kernel = info.linear_kernel_selector(config)(config)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self._kernel().process_weights_after_loading(layer)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._kernel().apply(layer, x, bias)

    def _kernel(self) -> LinearKernel:
        if self.kernel is None:
            raise RuntimeError("acme_int4: create_weights was not called for this layer")
        return self.kernel


class Int4Config(QuantizationConfig):
    """``acme_int4``: settings ``group_size`` (even, default 32), ``modules_to_not_convert``."""

    name = "acme_int4"

    def __init__(self, group_size: int, skip: tuple[str, ...]) -> None:
        self.group_size = group_size
        self.skip = skip

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Int4Config:
        group_size = config.get("group_size", 32)
        if type(group_size) is not int or group_size < 2 or group_size % 2:
            raise ValidationError(f"group_size must be an even integer >= 2, got "
                                  f"{group_size!r}", param="group_size")
        skip = config.get("modules_to_not_convert") or []
        if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
            raise ValidationError(f"modules_to_not_convert must be a list of strings, got "
                                  f"{skip!r}", param="modules_to_not_convert")
        return cls(group_size, tuple(skip))

    @classmethod
    def config_filenames(cls) -> list[str]:
        return ["acme_int4.json"]

    @classmethod
    def supported_act_dtypes(cls) -> list[str]:
        return ["float32", "bfloat16", "float16"]

    @classmethod
    def is_supported(cls, platform: PlatformInfo) -> Support:
        return Support.yes()  # plain torch: any device

    def get_quant_method(self, layer: LayerInfo, prefix: str) -> QuantizeMethod | None:
        if layer.kind != "linear" or any(s in prefix for s in self.skip):
            return None
        return Int4LinearMethod(self.group_size)
