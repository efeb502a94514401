"""Linear kernels for scheme ``int8_w8a8`` (entries of ``engine.linear_kernels``).

The scheme's parameters (``int8_method.py``): ``weight`` ``int8 [out, in]`` and
``weight_scale`` ``float32 [out]``, ``W ~= weight * weight_scale[:, None]``. Both kernels
quantize the activations per token, symmetric (``x_scale[t] = max_i |x[t, i]| / 127``),
and return ``(x_q @ weight^T) * x_scale[t] * weight_scale[o] (+ bias)`` in the activation
dtype:

* ``int8_int_mm`` (priority 100, CPU): ``torch._int_mm`` (int8 x int8 -> int32 through
  oneDNN, which uses AVX512-VNNI / AMX where the CPU has them). The weight is used as a
  transposed view of the ``[out, in]`` tensor (oneDNN's preferred layout; no copy).
* ``int8_reference`` (priority 0, any device): the same arithmetic with a float32 matmul of
  the integer values (exact for sums below 2**24, i.e. up to ~1000 input features).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from engine.sdk.capture import CaptureContext, GraphKind
from engine.sdk.linear_kernel import LinearKernel, LinearKernelConfig
from engine.sdk.platform import PlatformInfo
from engine.sdk.support import Support

SCHEME = "int8_w8a8"
ACT_DTYPES = ("bfloat16", "float16", "float32")
INT8_MAX = 127


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 of ``x`` ``[tokens, k]``: ``(q int8, scale float32 [tokens, 1])``."""
    values = x.to(torch.float32, copy=True)  # a copy even for float32: ``x`` is not ours
    scale = values.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-12) / INT8_MAX
    q = values.div_(scale).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def _w8a8(config: LinearKernelConfig) -> Support:
    if config.scheme != SCHEME:
        return Support.no(f"scheme {config.scheme} is not {SCHEME}")
    if config.weight_dtype != "int8":
        return Support.no(f"weight dtype {config.weight_dtype} is not int8")
    if config.act_dtype not in ACT_DTYPES:
        return Support.no(f"activation dtype {config.act_dtype} is not supported; supported: "
                          f"{', '.join(ACT_DTYPES)}")
    if config.group_size is not None:
        return Support.no(f"group_size {config.group_size}: only per-channel scales")
    if config.zero_point:
        return Support.no("zero points are not supported (symmetric only)")
    return Support.yes()


def _params(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    weight, scale = layer.weight, getattr(layer, "weight_scale", None)
    if not isinstance(weight, torch.Tensor) or not isinstance(scale, torch.Tensor):
        raise TypeError("an int8_w8a8 layer needs 'weight' and 'weight_scale' tensors")
    return weight, scale


def _w8a8_matmul(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                 matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Quantize ``x`` per token, ``matmul(q, weight^T)`` the integers, scale, add ``bias``."""
    weight, w_scale = _params(layer)
    q, x_scale = quantize_tokens(x.reshape(-1, x.shape[-1]))
    values = matmul(q, weight.t()).float()
    values.mul_(x_scale).mul_(w_scale)
    if bias is not None:
        values += bias
    return values.to(x.dtype).view(*x.shape[:-1], values.shape[-1])


class Int8IntMMKernel(LinearKernel):
    """W8A8 through ``torch._int_mm`` (see the module docstring)."""

    name: ClassVar[str] = "int8_int_mm"
    priority: ClassVar[int] = 100

    @classmethod
    def is_supported(cls, platform: PlatformInfo) -> Support:
        if platform.device_type != "cpu":
            return Support.no(f"runs on the CPU only, not {platform.device_type}")
        if not hasattr(torch, "_int_mm"):
            return Support.no(f"torch {torch.__version__} has no torch._int_mm")
        return Support.yes()

    @classmethod
    def can_implement(cls, config: LinearKernelConfig) -> Support:
        return _w8a8(config)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return _w8a8_matmul(layer, x, bias, torch._int_mm)

    def capture_support(self, ctx: CaptureContext) -> Support:
        return Support.no("torch._int_mm and its quantization are torch compute, which no "
                          "graph the engine records on the CPU can replay")


class Int8ReferenceKernel(LinearKernel):
    """W8A8 with a float32 matmul of the integer values: any device, for checks."""

    name: ClassVar[str] = "int8_reference"
    priority: ClassVar[int] = 0

    @classmethod
    def is_supported(cls, platform: PlatformInfo) -> Support:
        return Support.yes()

    @classmethod
    def can_implement(cls, config: LinearKernelConfig) -> Support:
        return _w8a8(config)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return _w8a8_matmul(layer, x, bias, lambda q, w: q.float() @ w.float())

    def capture_support(self, ctx: CaptureContext) -> Support:
        """CUDA graphs: torch ops without host synchronisation; never the CPU step graph."""
        if ctx.kind is GraphKind.CUDA_GRAPHS:
            return Support.yes()
        return Support.no("its matmul is torch compute, which the CPU step graph cannot replay")
