"""gelu_and_mul: the reference against F.gelu-based math and the erf/tanh formulas."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from engine.sdk.ops import BUILTIN_OPS, CustomOp, GeluAndMulOp, SiluAndMulOp, check_replacement


def gelu_formula(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """GELU written out in float64: erf (exact) or tanh (approximation)."""
    h = x.double()
    if approximate == "tanh":
        return 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))
    return 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(20,), (7, 20), (2, 3, 20), (1, 1, 4, 2)])
def test_gelu_and_mul_matches_the_formula(approximate: str, dtype: torch.dtype,
                                          shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    x = torch.randn(*shape, dtype=dtype) * 3
    before = x.clone()
    op = GeluAndMulOp(approximate)  # type: ignore[arg-type]
    out = op(x)
    d = shape[-1] // 2
    gate, up = x[..., :d], x[..., d:]
    assert out.shape == (*shape[:-1], d) and out.dtype == dtype
    # Exactly the contract's expression, in x's dtype (as SiluAndMulOp's reference).
    assert torch.equal(out, F.gelu(gate, approximate=approximate) * up)
    # And the formula, computed in float64, within the dtype's rounding.
    want = (gelu_formula(gate, approximate) * up.double()).to(dtype)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 5e-2,
                                                                         "rtol": 2e-2}
    torch.testing.assert_close(out, want, **tol)
    assert torch.equal(x, before)  # input unchanged


def test_the_approximations_differ_and_default_is_exact() -> None:
    x = torch.linspace(-4, 4, 64).reshape(2, 32)
    exact, tanh = GeluAndMulOp()(x), GeluAndMulOp("tanh")(x)
    assert GeluAndMulOp().approximate == "none"
    assert not torch.equal(exact, tanh)
    torch.testing.assert_close(exact, tanh, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("bad", ["erf", "TANH", "", None, "gelu_pytorch_tanh"])
def test_other_approximations_are_a_clear_value_error(bad: object) -> None:
    with pytest.raises(ValueError, match=r"approximate=.*allowed: 'none', 'tanh'"):
        GeluAndMulOp(bad)  # type: ignore[arg-type]


def test_it_is_a_built_in_contract() -> None:
    assert BUILTIN_OPS["gelu_and_mul"] is GeluAndMulOp
    assert GeluAndMulOp.name == "gelu_and_mul"
    assert ".. versionadded:: 1.1" in (GeluAndMulOp.__doc__ or "")

    class FastGelu(GeluAndMulOp):
        def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
            return self.forward_native(x)

    assert check_replacement("gelu_and_mul", FastGelu).ok
    wrong = type("Renamed", (SiluAndMulOp,), {"name": "gelu_and_mul"})
    assert "does not subclass engine.sdk.ops.GeluAndMulOp" in check_replacement(
        "gelu_and_mul", wrong).reason
    assert FastGelu("tanh", dispatch_key="cpu")(torch.ones(3, 4)).shape == (3, 2)
    assert issubclass(GeluAndMulOp, CustomOp)
