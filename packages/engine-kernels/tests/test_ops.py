"""The custom-op replacements' CUDA paths against the SDK's ``forward_native`` references."""

from __future__ import annotations

import pytest
import torch

from engine.core.model_executor.layers.rope import cos_sin_cache, inv_frequencies
from engine.kernels import _jit
from engine.kernels.ops import GeluAndMul, RMSNorm, RotaryEmbedding, SiluAndMul
from engine.sdk.ops import RotaryEmbeddingOp, check_replacement

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
#: Each op computes what its reference computes, in the same precision; what is left are
#: float32 summation-order and exp differences, seen through a rounding to the dtype (one
#: ulp). Triton's interpreter rounds float32 to bfloat16 towards zero, not to nearest (a
#: GPU rounds to nearest, as torch does): one ulp more there.
INTERPRETED = _jit.INTERPRETED
ULP = {torch.float32: 2e-6, torch.float16: 1e-3,
       torch.bfloat16: 1.6e-2 if INTERPRETED else 8e-3}


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = ULP[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


def rounded_alike(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """One rounding of the same float32 value: equal (within an ulp in the interpreter)."""
    if INTERPRETED and expected.dtype == torch.bfloat16:
        torch.testing.assert_close(actual, expected, atol=0, rtol=2**-7)
    else:
        assert torch.equal(actual, expected)


@pytest.mark.parametrize("op", [RMSNorm, RotaryEmbedding, SiluAndMul, GeluAndMul])
def test_each_is_a_valid_replacement_of_its_op(op: type) -> None:
    assert check_replacement(op.name, op)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 200])
def test_rms_norm_and_its_fused_residual_add(dtype: torch.dtype, hidden: int,
                                             device: str) -> None:
    op = RMSNorm(hidden, eps=1e-5, dtype=dtype, dispatch_key="cuda").to(device)
    with torch.no_grad():
        op.weight.copy_(torch.randn(hidden) * 0.5 + 1)
    fused = torch.randn(5, 2 * hidden).to(dtype).to(device)
    x = fused[:, :hidden]  # strided rows, as a split projection gives them
    residual = torch.randn(5, hidden).to(dtype).to(device)
    close(op(x), op.forward_native(x))
    expected_y, expected_residual = op.forward_native(x.clone(), residual.clone())
    y, new_residual = op(x, residual)
    close(y, expected_y)
    rounded_alike(new_residual, expected_residual)  # one rounding of an exact sum
    assert new_residual.data_ptr() == residual.data_ptr()  # fused: written in place


YARN = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
        "original_max_position_embeddings": 128}


def llama3_cache(rotary_dim: int, max_position: int) -> torch.Tensor:
    inv_freq = inv_frequencies(rotary_dim, {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, max_position)
    return RotaryEmbeddingOp.default_cos_sin_cache(rotary_dim, max_position, inv_freq=inv_freq)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("is_neox", "head_size", "rotary_dim", "scaling"), [
    (True, 64, 64, "default"),
    (True, 128, 128, "llama3"),
    (False, 64, 64, "default"),
    (True, 80, 32, "llama3"),   # partial rotation: the rest passes through
    (True, 128, 96, "yarn"),    # cos and sin scaled by the attention factor (1.14)
])
def test_rotary_embedding(dtype: torch.dtype, is_neox: bool, head_size: int, rotary_dim: int,
                          scaling: str, device: str) -> None:
    cache = (llama3_cache(rotary_dim, 512) if scaling == "llama3" else
             cos_sin_cache(rotary_dim, 512, YARN) if scaling == "yarn" else
             RotaryEmbeddingOp.default_cos_sin_cache(rotary_dim, 512))
    op = RotaryEmbedding(head_size, rotary_dim, cache, is_neox,
                               dispatch_key="cuda").to(device)
    positions = torch.tensor([0, 1, 7, 300, 511, 64], device=device)
    qkv = torch.randn(6, (6 + 2 * 2) * head_size).to(dtype).to(device)
    query = qkv[:, : 6 * head_size].view(6, 6, head_size)
    key = qkv[:, 6 * head_size: 8 * head_size].view(6, 2, head_size)
    expected_q, expected_k = op.forward_native(positions, query.clone(), key.clone())
    q, k = op(positions, query, key)
    close(q, expected_q)
    close(k, expected_k)
    assert q.data_ptr() == query.data_ptr()  # rotated in place


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 1500])  # 1500: two column blocks, the second partial
def test_silu_and_mul(dtype: torch.dtype, d: int, device: str) -> None:
    op = SiluAndMul(dispatch_key="cuda")
    x = torch.randn(2, 3, 2 * d).to(dtype).to(device) * 3
    before = x.clone()
    close(op(x), op.forward_native(x))
    assert torch.equal(x, before)  # x is not modified


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 1500])  # 1500: two column blocks, the second partial
def test_gelu_and_mul(approximate: str, dtype: torch.dtype, d: int, device: str) -> None:
    """float32 against the float64 formula: torch's CPU erf is off by up to 1.5e-7 of
    ``gelu``'s scale, the kernel's (libdevice's, numpy's in the interpreter) is not."""
    op = GeluAndMul(approximate, dispatch_key="cuda")  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(d)
    x = (torch.randn(2, 3, 2 * d, generator=gen) * 3).to(dtype)
    x[0, 0, :4] = torch.tensor([-30.0, -9.0, 0.0, 30.0])  # saturated: tanh's exp stays finite
    wide = torch.randn(5, 3 * d, generator=gen).to(dtype)
    strided = wide[:, d // 2: d // 2 + 2 * d]  # rows of a wider tensor
    for t in (x, strided):
        want = (op.forward_native(t.double()).to(dtype) if dtype == torch.float32 else
                op.forward_native(t))
        before = t.clone()
        close(op(t.to(device)).cpu(), want)
        assert torch.equal(t, before)  # x is not modified


def test_gelu_and_mul_refuses_another_form_by_name(device: str) -> None:
    from engine.kernels.ops.op_kernels import gelu_and_mul

    with pytest.raises(ValueError, match="approximate='erf' is not supported; allowed: "):
        gelu_and_mul(torch.ones(2, 4, device=device), "erf")


def test_other_dispatch_keys_keep_the_reference() -> None:
    for key in ("native", "xpu"):  # the CPU runs C++ (test_cpu_ops.py), CUDA Triton
        x = torch.randn(4, 8)
        for op in (SiluAndMul(dispatch_key=key), GeluAndMul("tanh", dispatch_key=key)):
            assert torch.equal(op(x), op.forward_native(x))


def test_without_triton_a_cuda_op_is_refused_when_built(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.kernels import _triton

    monkeypatch.setattr(_triton.importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(RuntimeError, match=r"rms_norm runs Triton kernels on CUDA, "
                       r"but triton is not installed: pip install 'engine-server\[cuda\]'.*"
                       r"--custom-ops=-rms_norm"):
        RMSNorm(64, dispatch_key="cuda")
    with pytest.raises(RuntimeError, match=r"--custom-ops=-gelu_and_mul"):
        GeluAndMul("tanh", dispatch_key="cuda")
    RMSNorm(64, dispatch_key="cpu")  # the CPU runs C++: nothing to check
