"""engine-kernels' ``gelu_and_mul`` on the CPU (elementwise.cpp, vmath.h's erf and tanh).

The op built with the ``cpu`` dispatch key (the kernel) against the contract's reference
(``native``: ``F.gelu(x[..., :d], approximate) * x[..., d:]``) on the same inputs, both
GELU forms, float32 and bfloat16, rows of 1 to 2560 gates (odd ones, strided rows). The
gates sweep [-12, 12], through erf's two polynomials, tanh's, and where both saturate.

float32: within 2^-21 of ``|gate * up|`` of torch, whose erf (Abramowitz-Stegun) is off by
about 1.5e-7, and within 2^-22 of it of the exact value (float64), which torch's erf form
is not. bfloat16: the float32 GELU rounded, then the product rounded, as torch does: its
values but where the float32 GELUs differ across a rounding tie (one bfloat16 ulp), or where
``1 + tanh`` cancels (gates near -5, whose GELU is about 1e-7: torch's tanh rounds to -1
where vmath.h's rounds to the float32 beside it). The call is what a step graph records.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.cpu import ops
from engine.kernels.cpu.native import native_kernels
from engine.kernels.cpu.ops import CpuGeluAndMul as GeluAndMul
from engine.sdk.capture import CaptureContext, GraphKind
from engine.sdk.graph_calls import GraphValue, Pointer, recording

KERNELS = native_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None,
                                reason="no C++ compiler: the CPU kernels cannot be built")

APPROXIMATIONS = ["none", "tanh"]
DTYPES = [torch.float32, torch.bfloat16]
# [..., 2d]: one row, a wide prefill, many rows on every thread, 3-D, odd widths, d = 1.
SHAPES = [(1, 64), (7, 2560), (300, 512), (2, 3, 96), (5, 74), (4, 2), (3, 2062)]


@pytest.fixture(autouse=True)
def _inference() -> object:
    with torch.inference_mode():
        yield


def _input(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Gates a shuffled sweep of [-12, 12] (0 among them), ups random in [-2, 2]."""
    gen = torch.Generator().manual_seed(seed)
    d = shape[-1] // 2
    x = (torch.rand(*shape, generator=gen) * 4 - 2)
    gates = x[..., :d]
    sweep = torch.linspace(-12, 12, gates.numel())
    sweep[0] = 0.0
    gates.copy_(sweep[torch.randperm(sweep.numel(), generator=gen)].view(gates.shape))
    return x.to(dtype)


def check(got: torch.Tensor, x: torch.Tensor, approximate: str) -> None:
    """``got`` against the reference on ``x`` (see the module docstring)."""
    d = x.shape[-1] // 2
    gate, up = x[..., :d], x[..., d:]
    want = F.gelu(gate, approximate=approximate) * up
    assert got.shape == want.shape and got.dtype == x.dtype
    if x.dtype == torch.float32:
        scale = (gate.double() * up.double()).abs()
        exact = F.gelu(gate.double(), approximate=approximate) * up.double()
        assert ((got.double() - want.double()).abs() <= 2.0 ** -21 * scale).all()
        assert ((got.double() - exact).abs() <= 2.0 ** -22 * scale).all()
        return
    # bfloat16: the float32 GELU (torch's within float32's bound) rounded, times up, rounded.
    gelu = F.gelu(gate.float(), approximate=approximate)
    slack = 2.0 ** -21 * gate.float().abs()
    ends = [(gelu + side * slack).to(x.dtype) * up for side in (-1, 1)]
    assert ((torch.minimum(*ends) <= got) & (got <= torch.maximum(*ends))).all()


@pytest.mark.parametrize("approximate", APPROXIMATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gelu_and_mul_matches_the_reference(approximate: str, dtype: torch.dtype,
                                            shape: tuple[int, ...]) -> None:
    x = _input(shape, dtype, seed=shape[-1])
    before = x.clone()
    got = GeluAndMul(approximate, dispatch_key="cpu")(x)  # type: ignore[arg-type]
    assert torch.equal(x, before)  # the input is left alone
    check(got, x, approximate)


@pytest.mark.parametrize("approximate", APPROXIMATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows_are_read_in_place(approximate: str, dtype: torch.dtype) -> None:
    """Rows of a wider tensor (a fused projection's slice): the kernel, no copy."""
    wide = _input((9, 3 * 70), dtype, seed=5)
    x = wide[:, 35:35 + 2 * 70]
    calls: list[list[GraphValue]] = []

    class Recorder:
        def record_call(self, function: object, args: list[GraphValue]) -> None:
            calls.append(list(args))

    op = GeluAndMul(approximate, dispatch_key="cpu")  # type: ignore[arg-type]
    check(op(x), x, approximate)
    with recording(Recorder()):
        op(x)
    (args,) = calls
    assert isinstance(args[1], Pointer) and args[1].address == x.data_ptr()
    assert args[2] == 3 * 70 and args[5:8] == [9, 70, APPROXIMATIONS.index(approximate)]


@pytest.mark.parametrize("approximate", APPROXIMATIONS)
def test_special_values_give_the_references(approximate: str) -> None:
    """Infinities, NaN, tiny and huge gates, the edges of erf's and tanh's branches."""
    gates = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-30, -1e-30,
                          1e-6, -1e-6, 1e30, -1e30, 88.0, -88.0, 3.9, -3.9, 0.927734375,
                          -0.927734375, 0.625 / 0.7978845608, -5.5, -6.0, 30.0, -30.0])
    x = torch.cat([gates, torch.full_like(gates, 1.5)])[None]
    got = GeluAndMul(approximate, dispatch_key="cpu")(x)  # type: ignore[arg-type]
    want = F.gelu(gates, approximate=approximate)[None] * 1.5
    if approximate == "none":  # gelu(inf) = inf; torch's vectorized erf(inf) is NaN there
        assert torch.isnan(want[0, 2]) and got[0, 2] == float("inf")
        want[0, 2] = float("inf")
    near = (got - want).abs() <= 2.0 ** -21 * (gates * 1.5).abs()  # as check()'s
    assert (near | (got == want) | (got.isnan() & want.isnan())).all(), (got, want)


def test_a_step_graph_records_the_kernel_and_only_it() -> None:
    op = GeluAndMul("tanh", dispatch_key="cpu")
    assert op.capture_support(CaptureContext(kind=GraphKind.CPU_STEP_GRAPH)).ok
    reference = GeluAndMul("tanh", dispatch_key="native")
    answer = reference.capture_support(CaptureContext(kind=GraphKind.CPU_STEP_GRAPH))
    assert not answer.ok and "not the engine's CPU kernel" in answer.reason
    assert KERNELS is not None and "gelu_and_mul" in KERNELS.graph_functions
    calls: list[str] = []

    class Recorder:
        def record_call(self, function: object, args: list[GraphValue]) -> None:
            calls.append(getattr(function, "name", ""))

    with recording(Recorder()):
        op(torch.randn(4, 32))
    assert calls == ["gelu_and_mul"]


def test_calls_the_kernel_does_not_take_run_the_reference(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    op = GeluAndMul(dispatch_key="cpu")
    half = torch.randn(4, 64, dtype=torch.float16)
    assert torch.equal(op(half), op.forward_native(half))  # float16: the reference
    with pytest.raises(RuntimeError):  # the reference's own error for an odd width
        op(torch.randn(3, 5))
    with torch.inference_mode(False):
        x = torch.randn(3, 16, requires_grad=True)
        op(x).sum().backward()  # an autograd graph: the reference, differentiable
        assert x.grad is not None
    monkeypatch.setattr(ops, "native_kernels", lambda: None)  # no compiler
    x32 = torch.randn(4, 64)
    assert torch.equal(op(x32), op.forward_native(x32))


def test_the_library_refuses_what_it_would_misread() -> None:
    assert KERNELS is not None
    x, out = torch.randn(4, 16), torch.empty(4, 8)
    with pytest.raises(ValueError, match=r"approximate='erf' is not supported; allowed: "
                                         r"'none', 'tanh'"):
        KERNELS.gelu_and_mul(x, out, "erf")
    with pytest.raises(ValueError, match="expected"):
        KERNELS.gelu_and_mul(x, torch.empty(4, 7), "none")
    with pytest.raises(ValueError, match="dtype torch.float64 not supported"):
        KERNELS.gelu_and_mul(x.double(), out.double(), "none")
    with pytest.raises(ValueError, match="4 input rows, 3 output rows"):
        KERNELS.gelu_and_mul(x, torch.empty(3, 8), "tanh")
