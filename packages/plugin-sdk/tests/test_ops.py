"""Custom ops: reference semantics against plain torch formulas, dispatch, replacements."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from engine.sdk._version import __version__
from engine.sdk.ops import (
    BUILTIN_OPS,
    NATIVE,
    CustomOp,
    RMSNormOp,
    RotaryEmbeddingOp,
    SiluAndMulOp,
    check_replacement,
)

# --- rms_norm ---------------------------------------------------------------------------------


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face Llama's LlamaRMSNorm.forward."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_the_llama_formula(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    op = RMSNormOp(64, eps=1e-5, dtype=dtype)
    with torch.no_grad():
        op.weight.copy_(torch.randn(64))
    x = torch.randn(5, 64, dtype=dtype) * 3
    out = op(x)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, hf_rms_norm(x, op.weight, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_residual_adds_first_and_returns_the_sum(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    op = RMSNormOp(32, dtype=dtype)
    x, residual = torch.randn(2, 3, 32, dtype=dtype), torch.randn(2, 3, 32, dtype=dtype)
    y, new_residual = op(x, residual)
    total = (x.float() + residual.float()).to(dtype)
    torch.testing.assert_close(new_residual, total)
    expected = hf_rms_norm(x.float() + residual.float(), op.weight, 1e-6).to(dtype)
    torch.testing.assert_close(y, expected)


def test_rms_norm_weight_is_in_the_state_dict() -> None:
    assert list(RMSNormOp(8).state_dict()) == ["weight"]


# --- rotary_embedding -------------------------------------------------------------------------


def hf_rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def make_rope(head_size: int, rotary_dim: int, neox: bool) -> RotaryEmbeddingOp:
    cache = RotaryEmbeddingOp.default_cos_sin_cache(rotary_dim, 64, base=10000.0)
    return RotaryEmbeddingOp(head_size, rotary_dim, cache, is_neox_style=neox)


def test_default_cache_holds_cos_then_sin() -> None:
    cache = RotaryEmbeddingOp.default_cos_sin_cache(8, 16, base=100.0)
    assert cache.shape == (16, 8)
    inv_freq = 100.0 ** -(torch.arange(0, 8, 2).float() / 8)
    angles = torch.arange(16).float()[:, None] * inv_freq
    torch.testing.assert_close(cache, torch.cat((angles.cos(), angles.sin()), dim=-1))


def test_rope_neox_style_matches_hf_rotate_half() -> None:
    torch.manual_seed(0)
    op = make_rope(16, 16, neox=True)
    positions = torch.tensor([0, 3, 7, 63])
    q, k = torch.randn(4, 4, 16), torch.randn(4, 2, 16)
    q_out, k_out = op(positions, q.clone(), k.clone())
    inv_freq = 10000.0 ** -(torch.arange(0, 16, 2).float() / 16)
    emb = torch.cat([positions.float()[:, None] * inv_freq] * 2, dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    torch.testing.assert_close(q_out, q * cos + hf_rotate_half(q) * sin)
    torch.testing.assert_close(k_out, k * cos + hf_rotate_half(k) * sin)


def test_rope_gptj_style_rotates_adjacent_pairs_as_complex_numbers() -> None:
    torch.manual_seed(0)
    op = make_rope(8, 8, neox=False)
    positions = torch.tensor([1, 5])
    q, k = torch.randn(2, 3, 8), torch.randn(2, 1, 8)
    q_out, k_out = op(positions, q.clone(), k.clone())
    inv_freq = 10000.0 ** -(torch.arange(0, 8, 2).float() / 8)
    rotation = torch.polar(torch.ones(2, 4), positions.float()[:, None] * inv_freq)[:, None, :]
    for x, out in ((q, q_out), (k, k_out)):
        expected = torch.view_as_real(torch.view_as_complex(x.reshape(*x.shape[:-1], 4, 2))
                                      * rotation).flatten(-2)
        torch.testing.assert_close(out, expected)


def test_rope_partial_rotary_passes_the_rest_through_in_bf16() -> None:
    torch.manual_seed(0)
    op = make_rope(16, 8, neox=True)
    q, k = torch.randn(3, 2, 16, dtype=torch.bfloat16), torch.randn(3, 1, 16, dtype=torch.bfloat16)
    q_out, k_out = op(torch.tensor([0, 1, 2]), q, k)
    assert q_out.dtype == torch.bfloat16 and q_out.shape == q.shape
    assert torch.equal(q_out[..., 8:], q[..., 8:]) and torch.equal(k_out[..., 8:], k[..., 8:])
    assert torch.equal(q_out[0], q[0])  # position 0 is the identity rotation
    assert not torch.equal(q_out[1, :, :8], q[1, :, :8])


def test_rope_cache_is_a_non_persistent_buffer_and_geometry_is_checked() -> None:
    op = make_rope(16, 16, neox=True)
    assert "cos_sin_cache" in dict(op.named_buffers()) and not op.state_dict()
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        RotaryEmbeddingOp(16, 7, torch.zeros(4, 7))
    with pytest.raises(ValueError, match="cos_sin_cache must be"):
        RotaryEmbeddingOp(16, 8, torch.zeros(4, 16))


# --- silu_and_mul -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_the_formula(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 20, dtype=dtype)
    before = x.clone()
    out = SiluAndMulOp()(x)
    gate, up = x[..., :10], x[..., 10:]
    assert out.shape == (2, 3, 10) and out.dtype == dtype
    torch.testing.assert_close(out, gate * torch.sigmoid(gate) * up)
    assert torch.equal(x, before)


# --- dispatch ---------------------------------------------------------------------------------


class Recording(SiluAndMulOp):
    """A replacement that records which path ran."""

    calls: ClassVar[list[str]] = []

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append("native")
        return super().forward_native(x)

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append("cpu")
        return super().forward_native(*args, **kwargs)

    def forward_oot(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append("oot")
        return super().forward_native(*args, **kwargs)


@pytest.mark.parametrize(
    ("key", "expected"),
    [(NATIVE, ["native"]), ("cpu", ["cpu"]), ("cuda", ["native"]), ("npu", ["oot"])],
)
def test_dispatch_is_chosen_from_the_key_at_construction(key: str, expected: list[str]) -> None:
    Recording.calls.clear()
    op = Recording(dispatch_key=key)
    assert op.dispatch_key == key
    op(torch.randn(2, 4))
    assert Recording.calls == expected  # forward_cuda was not overridden: falls back to native


def test_default_dispatch_is_the_reference() -> None:
    Recording.calls.clear()
    Recording()(torch.randn(2, 4))
    assert Recording.calls == ["native"]
    assert RMSNormOp(4).dispatch_key == NATIVE


def test_forward_native_is_required() -> None:
    class NoReference(CustomOp):
        name = "no_reference"

    with pytest.raises(TypeError, match="forward_native"):
        NoReference()  # type: ignore[abstract]


def test_sdk_version_is_recorded_on_ops_and_replacements() -> None:
    assert RMSNormOp.sdk_version == __version__
    assert Recording.sdk_version == __version__
    assert Recording.name == "silu_and_mul"


# --- replacements -----------------------------------------------------------------------------


class InPlaceRMSNorm(RMSNormOp):
    """A 'fused kernel' for the CPU that overwrites its inputs, as the contract allows."""

    def forward_cpu(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            residual.add_(x)
            x.copy_(residual)
        rms = x.float().pow(2).mean(-1, keepdim=True).add(self.eps).rsqrt()
        x.copy_((x.float() * rms).to(x.dtype) * self.weight)
        return x if residual is None else (x, residual)


def test_replacement_matches_the_reference_on_cloned_inputs() -> None:
    torch.manual_seed(0)
    reference, candidate = RMSNormOp(16), InPlaceRMSNorm(16, dispatch_key="cpu")
    x, residual = torch.randn(4, 16), torch.randn(4, 16)
    expected = reference(x.clone(), residual.clone())
    got = candidate(x.clone(), residual.clone())
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e)


def test_check_replacement() -> None:
    assert set(BUILTIN_OPS) == {"rms_norm", "rotary_embedding", "silu_and_mul", "gelu_and_mul",
                                "fused_moe"}
    assert check_replacement("rms_norm", InPlaceRMSNorm).ok
    assert "does not subclass engine.sdk.ops.RMSNormOp" in check_replacement(
        "rms_norm", type("Renamed", (SiluAndMulOp,), {"name": "rms_norm"})
    ).reason
    wrong_name = check_replacement("silu_and_mul", InPlaceRMSNorm)
    assert "registered as 'silu_and_mul'" in wrong_name.reason
    assert "not a subclass of engine.sdk.ops.CustomOp" in check_replacement("rms_norm", int).reason

    class NewOp(CustomOp):
        name = "gelu_tanh"

        def forward_native(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.gelu(x, approximate="tanh")

    assert check_replacement("gelu_tanh", NewOp).ok  # a new op has no built-in contract

    class Abstract(CustomOp):
        name = "abstract_op"

    assert "abstract" in check_replacement("abstract_op", Abstract).reason
