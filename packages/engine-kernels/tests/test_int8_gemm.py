"""``int8_triton``: the W8A8 kernels against their torch reference and engine-core's kernel."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from engine.core.quantization.int8_kernels import Int8IntMMKernel, Int8ReferenceKernel
from engine.core.quantization.int8_method import quantize_per_channel
from engine.kernels import _jit
from engine.kernels.linear import TritonInt8Kernel
from engine.kernels.linear.int8_kernels import quantize_per_token, w8a8_linear
from engine.kernels.linear.reference import w8a8_linear_reference
from engine.sdk.linear_kernel import LinearKernelConfig, select_linear_kernel
from engine.sdk.platform import PlatformInfo

CONFIG = LinearKernelConfig(scheme="int8_w8a8", weight_dtype="int8", act_dtype="bfloat16",
                            input_size=200, output_size=96)
CUDA = PlatformInfo(name="cuda", device_type="cuda", device_capability=(8, 0))


def test_activations_round_half_to_even_like_torch(device: str) -> None:
    x = torch.tensor([[127.0, 63.5, 0.5, 1.5, 2.5, -2.5, -0.5, 100.2]], device=device)
    q, scale = quantize_per_token(x)
    assert q.tolist() == [[127, 64, 0, 2, 2, -2, 0, 100]] and scale.tolist() == [1.0]
    zeros, zero_scale = quantize_per_token(torch.zeros(2, 5, device=device))
    assert not zeros.any() and torch.all(zero_scale > 0)  # no division by zero


def layer(n: int, k: int, dtype: torch.dtype, device: str, bias: bool) -> nn.Module:
    module = nn.Module()
    q, scale = quantize_per_channel(torch.randn(n, k))
    module.weight = nn.Parameter(q.to(device), requires_grad=False)
    module.weight_scale = nn.Parameter(scale.to(device), requires_grad=False)
    module.bias = nn.Parameter(torch.randn(n).to(dtype).to(device)) if bias else None
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "bias"), [(1, False), (5, True), (40, True)])
def test_the_gemm_equals_the_reference(dtype: torch.dtype, m: int, bias: bool,
                                       device: str) -> None:
    lin = layer(96, 200, dtype, device, bias)  # partial N and K tiles
    x = torch.randn(m, 200).to(dtype).to(device) * 2
    out = w8a8_linear(x, lin.weight, lin.weight_scale, lin.bias)
    cpu = [t.cpu() if t is not None else None for t in (x, lin.weight, lin.weight_scale, lin.bias)]
    expected = w8a8_linear_reference(*cpu)
    if _jit.INTERPRETED and dtype == torch.bfloat16:  # it rounds to bfloat16 towards zero
        torch.testing.assert_close(out.cpu(), expected, atol=0, rtol=2**-7)
    else:  # int32 sums are exact, the float32 epilogue is the same operations in order
        assert torch.equal(out.cpu(), expected)


def test_it_computes_what_engine_cores_int8_kernel_computes(device: str) -> None:
    lin = layer(64, 128, torch.float32, device, bias=True)
    x = torch.randn(3, 7, 128, device=device)
    config = dataclasses.replace(CONFIG, act_dtype="float32", input_size=128, output_size=64,
                                 has_bias=True)
    ours = TritonInt8Kernel(config).apply(lin, x, lin.bias)
    cpu = nn.Module()
    for name in ("weight", "weight_scale", "bias"):
        setattr(cpu, name, nn.Parameter(getattr(lin, name).cpu(), requires_grad=False))
    theirs = Int8ReferenceKernel(config).apply(cpu, x.cpu(), cpu.bias)
    assert ours.shape == (3, 7, 64) and torch.equal(ours.cpu(), theirs)


def test_selection_prefers_it_on_cuda_and_explains_elsewhere() -> None:
    kernels = [TritonInt8Kernel, Int8ReferenceKernel, Int8IntMMKernel]
    assert select_linear_kernel(kernels, CUDA, CONFIG) is TritonInt8Kernel
    turing = dataclasses.replace(CUDA, device_capability=(7, 5))
    assert select_linear_kernel(kernels, turing, CONFIG) is Int8ReferenceKernel
    assert TritonInt8Kernel.is_supported(turing).reason == (
        "int8 tensor-core matmuls need compute capability >= 8.0, found 7.5")
    npu = PlatformInfo(name="acme", device_type="npu")
    assert "run on CUDA devices, not npu" in TritonInt8Kernel.is_supported(npu).reason


@pytest.mark.parametrize(("change", "reason"), [
    ({"scheme": "fp8_w8a8"}, "scheme fp8_w8a8 is not int8_w8a8"),
    ({"weight_dtype": "uint4"}, "weight dtype uint4 is not int8"),
    ({"act_dtype": "float64"}, "activation dtype float64 is not supported; supported: "
                               "bfloat16, float16, float32"),
    ({"group_size": 128}, "group_size 128: only per-channel scales"),
    ({"zero_point": True}, "zero points are not supported (symmetric only)"),
])
def test_can_implement_names_the_field(change: dict[str, object], reason: str) -> None:
    answer = TritonInt8Kernel.can_implement(dataclasses.replace(CONFIG, **change))
    assert not answer.ok and answer.reason == reason
