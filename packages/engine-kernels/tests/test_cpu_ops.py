"""The CPU ops (``engine.kernels.cpu.ops``, C++ kernels) against the SDK's references.

Each op is built twice from its class: with the ``cpu`` dispatch key
(the kernels) and with ``native`` (the contract's reference), and run on clones of the
same inputs. Rotation and bfloat16 SiLU-and-mul must match bit for bit, RMSNorm to the
order of its float32 sum; the residual RMSNorm returns is ``x + residual`` exactly.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels.cpu import ops
from engine.kernels.cpu.ops import CpuRMSNorm as RMSNorm
from engine.kernels.cpu.ops import CpuRotaryEmbedding as RotaryEmbedding
from engine.kernels.cpu.ops import CpuSiluAndMul as SiluAndMul
from engine.sdk.ops import RotaryEmbeddingOp

pytestmark = pytest.mark.skipif(ops.native_kernels() is None,
                                reason="no C++ compiler: the CPU kernels cannot be built")

DTYPES = [torch.float32, torch.bfloat16]
TOKENS = [1, 7, 300]  # 300 rows: large enough to run on every thread


def _ulp(dtype: torch.dtype) -> float:
    return 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -22


@pytest.fixture(autouse=True)
def _inference() -> object:
    with torch.inference_mode():
        yield


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_the_reference(dtype: torch.dtype, tokens: int,
                                        with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(tokens)
    fast, ref = (RMSNorm(192, 1e-5, dtype=dtype, dispatch_key=key) for key in ("cpu", "native"))
    weight = torch.randn(192, generator=gen).to(dtype)
    fast.weight.copy_(weight)
    ref.weight.copy_(weight)
    x = (torch.randn(tokens, 192, generator=gen) * 3).to(dtype)
    residual = torch.randn(tokens, 192, generator=gen).to(dtype) if with_residual else None
    expected = ref(x.clone(), None if residual is None else residual.clone())
    x_in = x.clone()
    got = fast(x_in, None if residual is None else residual.clone())
    if residual is None:
        assert isinstance(got, torch.Tensor) and isinstance(expected, torch.Tensor)
        got_y, want_y = got, expected
    else:
        got_y, got_res = got
        want_y, want_res = expected
        assert torch.equal(got_res, want_res)
    assert got_y.data_ptr() == x_in.data_ptr()  # normalised in place: the kernel ran
    scale = want_y.float().abs().clamp_min(1.0)
    assert ((got_y.float() - want_y.float()).abs() <= 2 * _ulp(dtype) * scale).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize(("neox", "rotary_dim", "attention_factor"), [
    (True, 64, 1.0), (False, 64, 1.0), (True, 32, 1.0),
    (True, 64, 1.1386),  # YaRN's factor 4: cos and sin scaled in the cache
])
def test_rotary_embedding_matches_the_reference_bit_for_bit(
        dtype: torch.dtype, tokens: int, neox: bool, rotary_dim: int,
        attention_factor: float) -> None:
    gen = torch.Generator().manual_seed(tokens)
    cache = RotaryEmbeddingOp.default_cos_sin_cache(rotary_dim, 4096) * attention_factor
    fast, ref = (RotaryEmbedding(64, rotary_dim, cache, neox, dispatch_key=key)
                 for key in ("cpu", "native"))
    # The model's layout: query and key are views into one qkv row (strided tokens).
    qkv = torch.randn(tokens, (6 + 2 + 2) * 64, generator=gen).to(dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)

    def views(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return t[:, :384].view(tokens, 6, 64), t[:, 384:512].view(tokens, 2, 64)

    want_q, want_k = ref(positions, *views(qkv.clone()))
    rotated = qkv.clone()
    got_q, got_k = fast(positions, *views(rotated))
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert got_q.data_ptr() == rotated.data_ptr()  # rotated in place: the kernel ran
    assert torch.equal(rotated[:, 512:], qkv[:, 512:])  # the values are untouched


def test_a_position_outside_the_cache_is_an_index_error_and_writes_nothing() -> None:
    op = RotaryEmbedding(64, 64, RotaryEmbeddingOp.default_cos_sin_cache(64, 16),
                         dispatch_key="cpu")
    query, key = torch.randn(2, 2, 64), torch.randn(2, 1, 64)
    before = query.clone(), key.clone()
    with pytest.raises(IndexError, match=r"outside the cos/sin cache \(0..15\)"):
        op(torch.tensor([3, 16]), query, key)
    assert torch.equal(query, before[0]) and torch.equal(key, before[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 2560), (300, 512), (2, 3, 96)])
def test_silu_and_mul_matches_the_reference(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(len(shape))
    x = (torch.randn(*shape, generator=gen) * 4).to(dtype)
    x[0, ..., 0] = -100.0  # exp's clamp: silu still ~0
    x[-1, ..., 1] = 90.0
    before = x.clone()
    got = SiluAndMul(dispatch_key="cpu")(x)
    want = SiluAndMul(dispatch_key="native")(x)
    assert torch.equal(x, before)  # the input is left alone
    assert got.shape == want.shape and got.dtype == dtype
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:  # float32: exp may differ from torch's in the last bit
        torch.testing.assert_close(got, want, rtol=4 * _ulp(dtype), atol=1e-30)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_per_head_rows_runs_the_kernel(dtype: torch.dtype) -> None:
    """``[tokens, heads, head_size]`` (Qwen3's q/k norms) is ``[tokens * heads, head_size]``
    rows for the kernel; heads that are not evenly spaced get the reference."""
    gen = torch.Generator().manual_seed(3)
    fast, ref = (RMSNorm(32, 1e-6, dtype=dtype, dispatch_key=key) for key in ("cpu", "native"))
    weight = torch.randn(32, generator=gen).to(dtype)
    fast.weight.copy_(weight)
    ref.weight.copy_(weight)
    qkv = (torch.randn(5, 4 * 32 + 64, generator=gen) * 3).to(dtype)
    heads = qkv[:, :128].reshape(5, 4, 32).contiguous()
    expected = ref(heads.clone())
    got = fast(heads)
    assert got.data_ptr() == heads.data_ptr() and got.shape == (5, 4, 32)  # in place
    scale = expected.float().abs().clamp_min(1.0)
    assert ((got.float() - expected.float()).abs() <= 2 * _ulp(dtype) * scale).all()
    strided = qkv[:, :128].reshape(5, 4, 32)  # rows 192 apart, heads 32: no single stride
    kept = strided.clone()
    assert torch.equal(fast(strided), ref(kept.clone()))  # the reference, not in place
    assert torch.equal(strided, kept)


def test_calls_the_kernels_do_not_take_run_the_reference(monkeypatch) -> None:
    x = torch.randn(4, 64, dtype=torch.float16)
    op = RMSNorm(64, dtype=torch.float16, dispatch_key="cpu")
    y = op(x.clone())
    assert torch.equal(y, RMSNorm(64, dtype=torch.float16)(x.clone()))  # float16: reference
    silu = SiluAndMul(dispatch_key="cpu")
    odd = torch.randn(3, 5)
    with pytest.raises(RuntimeError):  # the reference's own error for an odd width
        silu(odd)
    monkeypatch.setattr(ops, "native_kernels", lambda: None)  # no compiler
    x32 = torch.randn(4, 64)
    kept = x32.clone()
    assert torch.equal(RMSNorm(64, dispatch_key="cpu")(x32), RMSNorm(64)(kept.clone()))
    assert torch.equal(x32, kept)  # the reference does not work in place


def test_an_autograd_graph_gets_the_reference() -> None:
    with torch.inference_mode(False):
        op = RMSNorm(16, dispatch_key="cpu")
        x = torch.randn(3, 16, requires_grad=True)
        op(x).sum().backward()
        assert x.grad is not None and op.weight.grad is not None
