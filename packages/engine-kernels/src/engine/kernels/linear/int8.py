"""``int8_triton``: scheme ``int8_w8a8`` (the quantization method ``int8``) on CUDA.

The layer's parameters are the scheme's (engine-core's ``int8`` method registers them):
``weight`` int8 ``[out, in]`` and ``weight_scale`` float32 ``[out]``. Activations are
quantized per token by one Triton kernel, then one Triton GEMM multiplies the int8 values
on the tensor cores with int32 accumulation and applies both scales and the bias
(``int8_kernels``); the result equals engine-core's ``int8_reference`` kernel's.

Priority 100 (an optimized built-in): on CUDA it wins over ``int8_reference`` (0).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from engine.kernels._triton import device_problem
from engine.sdk.capture import CaptureContext, GraphKind
from engine.sdk.linear_kernel import LinearKernel, LinearKernelConfig
from engine.sdk.platform import PlatformInfo
from engine.sdk.support import Support

SCHEME = "int8_w8a8"
ACT_DTYPES = ("bfloat16", "float16", "float32")
#: int8 tensor-core matmuls (mma.s8) in Triton: Ampere and newer.
MIN_CAPABILITY = (8, 0)


class TritonInt8Kernel(LinearKernel):
    """W8A8 with Triton kernels (see the module docstring)."""

    name: ClassVar[str] = "int8_triton"
    priority: ClassVar[int] = 100

    @classmethod
    def is_supported(cls, platform: PlatformInfo) -> Support:
        problem = device_problem(platform.device_type)
        if problem is not None:
            return Support.no(problem)
        capability = platform.device_capability
        if platform.device_type == "cuda" and capability is not None \
                and tuple(capability) < MIN_CAPABILITY:
            return Support.no(f"int8 tensor-core matmuls need compute capability >= "
                              f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}, found "
                              f"{capability[0]}.{capability[1]}")
        return Support.yes()

    @classmethod
    def can_implement(cls, config: LinearKernelConfig) -> Support:
        if config.scheme != SCHEME:
            return Support.no(f"scheme {config.scheme} is not {SCHEME}")
        if config.weight_dtype != "int8":
            return Support.no(f"weight dtype {config.weight_dtype} is not int8")
        if config.act_dtype not in ACT_DTYPES:
            return Support.no(f"activation dtype {config.act_dtype} is not supported; "
                              f"supported: {', '.join(ACT_DTYPES)}")
        if config.group_size is not None:
            return Support.no(f"group_size {config.group_size}: only per-channel scales")
        if config.zero_point:
            return Support.no("zero points are not supported (symmetric only)")
        return Support.yes()

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight
        if isinstance(weight, torch.Tensor) and weight.stride(-1) != 1:
            layer.register_parameter("weight", nn.Parameter(weight.contiguous(),
                                                            requires_grad=False))

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        from engine.kernels.linear.int8_kernels import w8a8_linear

        weight, scale = layer.weight, getattr(layer, "weight_scale", None)
        if not isinstance(weight, torch.Tensor) or not isinstance(scale, torch.Tensor):
            raise TypeError("an int8_w8a8 layer needs 'weight' and 'weight_scale' tensors")
        return w8a8_linear(x, weight, scale, bias)

    def capture_support(self, ctx: CaptureContext) -> Support:
        """CUDA graphs: Triton launches only (no host synchronisation)."""
        if ctx.kind is GraphKind.CUDA_GRAPHS:
            return Support.yes()
        return Support.no("its Triton kernels run on CUDA only, not in the CPU step graph")
