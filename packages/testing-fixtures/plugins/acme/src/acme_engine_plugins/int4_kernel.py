"""``engine.linear_kernels`` entry ``acme_int4_dequant``: the ``acme_int4`` scheme in torch.

Dequantizes the layer's weight (``unpack * scales``) in the activation dtype at every call,
then one ``F.linear``: memory stays at ~4.5 bits per weight, compute is a plain matmul.
Priority 10: a fallback that a faster kernel for the scheme (priority > 10) replaces.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F

from acme_engine_plugins.int4 import SCHEME
from acme_engine_plugins.int4_format import dequantize
from engine.sdk.linear_kernel import LinearKernel, LinearKernelConfig
from engine.sdk.platform import PlatformInfo
from engine.sdk.support import Support


class Int4DequantKernel(LinearKernel):
    """Dequantize, then ``F.linear``; any device, any float activation dtype."""

    name = "acme_int4_dequant"
    priority = 10

    @classmethod
    def is_supported(cls, platform: PlatformInfo) -> Support:
        return Support.yes()

    @classmethod
    def can_implement(cls, config: LinearKernelConfig) -> Support:
        if config.scheme != SCHEME:
            return Support.no(f"scheme {config.scheme} is not {SCHEME}")
        if config.weight_dtype != "int4":
            return Support.no(f"weight dtype {config.weight_dtype}: only int4")
        if config.act_dtype not in ("float32", "bfloat16", "float16"):
            return Support.no(f"activation dtype {config.act_dtype}: float32, bfloat16 or "
                              f"float16 only")
        if config.group_size is None or config.group_size % 2:
            return Support.no(f"group_size {config.group_size}: an even group size only")
        if config.input_size % config.group_size:
            return Support.no(f"input size {config.input_size} is not whole groups of "
                              f"{config.group_size}")
        if config.zero_point:
            return Support.no("asymmetric (zero-point) weights are not supported")
        return Support.yes()

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        qweight, scales = cast(torch.Tensor, layer.qweight), cast(torch.Tensor, layer.scales)
        weight = dequantize(qweight, scales, x.dtype)
        return F.linear(x, weight, bias)
