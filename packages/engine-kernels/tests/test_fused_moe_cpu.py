"""engine-kernels' ``fused_moe`` on the CPU (one native call, fused_moe.cpp) against the SDK.

Each case builds the op with the ``cpu`` dispatch key (the kernel) and runs the contract's
reference ``FusedMoEOp.forward_native`` on the same weights and inputs: random shapes
(intermediate and hidden sizes that are not whole panels), top_k 1 to E, renormalize on
and off, 1 to 300 tokens, float32 and bfloat16. float32 agrees to the products' sum order;
bfloat16 to a rounding of the expert outputs. GPT-OSS's options too: the clamped SwiGLU
(a small limit, so that both clamps bite) and the experts' biases, each alone and both.
Routing ties (equal logits) go as ``torch.topk`` sends them. The call must not change its
inputs, and it is what a step graph records: one ``fused_moe`` call, nothing read back
(with the options as with none); an option it does not implement runs the reference.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels.cpu.moe import IMPLEMENTED, PANEL_NAMES, CpuFusedMoE
from engine.kernels.cpu.native import native_kernels
from engine.kernels.ops import FusedMoE
from engine.sdk.capture import CaptureContext, GraphKind
from engine.sdk.graph_calls import GraphValue, Pointer, recording
from engine.sdk.ops import FusedMoEOp

KERNELS = native_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None,
                                reason="no C++ compiler: the CPU kernels cannot be built")
PACKED = [] if KERNELS is None else sorted(KERNELS.packed_matmul_dtypes, key=str)
# (experts, top_k, hidden, intermediate)
SHAPES = [(8, 2, 64, 48), (4, 1, 40, 70), (16, 2, 96, 32), (3, 3, 34, 18), (6, 4, 128, 100)]
TOKENS = [1, 3, 17, 300]
# GPT-OSS's options: the clamped SwiGLU (limit 1: gate and up, about N(0, 1) here, reach
# it), the experts' biases, both.
OPTIONS = [{"activation": "swigluoai", "swiglu_limit": 1.0}, {"bias": True},
           {"activation": "swigluoai", "swiglu_alpha": 1.702, "swiglu_limit": 1.0,
            "bias": True}]


def _op(experts: int, top_k: int, hidden: int, size: int, dtype: torch.dtype,
        renormalize: bool, seed: int, **options: object) -> CpuFusedMoE:
    gen = torch.Generator().manual_seed(seed)
    op = FusedMoE(experts, top_k, hidden, size, renormalize=renormalize, dtype=dtype,
                  dispatch_key="cpu", **options)
    op.w13.copy_((torch.randn(op.w13.shape, generator=gen) * hidden ** -0.5).to(dtype))
    op.w2.copy_((torch.randn(op.w2.shape, generator=gen) * size ** -0.5).to(dtype))
    for bias in (op.w13_bias, op.w2_bias):
        if bias is not None:
            bias.copy_((torch.randn(bias.shape, generator=gen) * 0.5).to(dtype))
    op.process_weights_after_loading()
    return op


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-5,
                                                                          "rtol": 1e-5}


@pytest.fixture(autouse=True)
def _inference() -> object:
    with torch.inference_mode():
        yield


def _matches_the_reference(op: CpuFusedMoE, tokens: int, experts: int, hidden: int,
                           dtype: torch.dtype) -> torch.Tensor:
    """``op`` on seeded random rows equals the SDK reference and leaves its inputs; the rows."""
    gen = torch.Generator().manual_seed(tokens + 1)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen) * 2
    x_in, logits_in = x.clone(), logits.clone()
    got = op(x, logits)
    want = FusedMoEOp.forward_native(op, x, logits)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    torch.testing.assert_close(got, want, **_tolerance(dtype))
    assert torch.equal(x, x_in) and torch.equal(logits, logits_in)
    return x


@pytest.mark.parametrize("dtype", PACKED)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("renormalize", [True, False])
def test_it_matches_the_reference(dtype: torch.dtype, shape: tuple[int, int, int, int],
                                  tokens: int, renormalize: bool) -> None:
    experts, _, hidden, _ = shape
    op = _op(*shape, dtype, renormalize, seed=tokens)
    assert op.panels() is not None  # the kernel runs, not the reference it falls back to
    _matches_the_reference(op, tokens, experts, hidden, dtype)


@pytest.mark.parametrize("dtype", PACKED)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("options", OPTIONS, ids=["swigluoai", "bias", "swigluoai-bias"])
def test_gpt_oss_options_match_the_reference(dtype: torch.dtype,
                                             shape: tuple[int, int, int, int], tokens: int,
                                             options: dict[str, object]) -> None:
    experts, _, hidden, _ = shape
    op = _op(*shape, dtype, True, seed=tokens, **options)
    assert op.extra_options() and op.panels() is not None  # the kernel, not the reference
    x = _matches_the_reference(op, tokens, experts, hidden, dtype)
    if op.activation == "swigluoai" and tokens == 300:  # the clamps took part
        gate_up = torch.nn.functional.linear(x.float(), op.w13[0].float())
        size = op.intermediate_size
        assert (gate_up[:, :size] > 1).any() and (gate_up[:, size:].abs() > 1).any()


@pytest.mark.parametrize("dtype", PACKED)
def test_bfloat16_logits_and_strided_rows(dtype: torch.dtype) -> None:
    op = _op(8, 2, 64, 48, dtype, True, seed=3)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(9, 128, generator=gen).to(dtype)[:, :64]  # rows 128 apart
    logits = torch.randn(9, 8, generator=gen).to(torch.bfloat16)
    torch.testing.assert_close(op(x, logits), FusedMoEOp.forward_native(op, x, logits),
                               **_tolerance(dtype))


@pytest.mark.parametrize("dtype", PACKED)
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_ties_go_as_torch_topk_sends_them(dtype: torch.dtype, top_k: int) -> None:
    """Equal logits (a zero router) and pairs of equal ones: the same experts as torch."""
    op = _op(8, top_k, 64, 48, dtype, False, seed=5)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(6, 64, generator=gen).to(dtype)
    logits = torch.zeros(6, 8)
    logits[1, 3] = logits[1, 5] = 1.0
    logits[2, 7] = logits[2, 0] = logits[2, 4] = 2.0
    logits[3] = torch.tensor([1.0, 0.5, 1.0, 0.5, 1.0, 0.5, 1.0, 0.5])
    got = op(x, logits)
    want = FusedMoEOp.forward_native(op, x, logits)
    # A different expert would change a row by far more than a rounding.
    torch.testing.assert_close(got, want, **_tolerance(dtype))


@pytest.mark.parametrize("tokens", [1, 40])
@pytest.mark.parametrize("options", [{}, OPTIONS[-1]], ids=["plain", "swigluoai-bias"])
def test_float32_weights_of_bfloat16_values(tokens: int, options: dict[str, object]) -> None:
    """A bfloat16 checkpoint run in float32: on a build that widens (AVX2), the panels are
    bfloat16, read back as float32, with the float32 products' results (float32 biases)."""
    assert KERNELS is not None
    if torch.float32 not in KERNELS.packed_matmul_dtypes:
        pytest.skip("no packed float32 product in this build")
    op = FusedMoE(6, 2, 64, 40, dtype=torch.float32, dispatch_key="cpu", **options)
    gen = torch.Generator().manual_seed(10)
    for w in op.parameters():
        w.copy_((torch.randn(w.shape, generator=gen) * 0.1).to(torch.bfloat16).float())
    op.process_weights_after_loading()
    panels = op.panels()
    assert panels is not None
    widened = KERNELS.packs_float32_as_bfloat16
    assert all(p.dtype == (torch.bfloat16 if widened else torch.float32) for p in panels)
    x, logits = torch.randn(tokens, 64, generator=gen), torch.randn(tokens, 6, generator=gen)
    torch.testing.assert_close(op(x, logits), FusedMoEOp.forward_native(op, x, logits),
                               **_tolerance(torch.float32))


@pytest.mark.parametrize("options", [{}, OPTIONS[-1]], ids=["plain", "swigluoai-bias"])
def test_a_step_graph_records_one_call_with_nothing_read_back(options: dict[str, object]
                                                               ) -> None:
    op = _op(8, 2, 64, 48, torch.float32, True, seed=7, **options)
    assert op.capture_support(CaptureContext(kind=GraphKind.CPU_STEP_GRAPH)).ok
    assert all(name in dict(op.named_buffers()) for name in PANEL_NAMES)
    assert PANEL_NAMES[0] not in op.state_dict()  # derived: not a checkpoint tensor
    calls: list[tuple[str, list[GraphValue]]] = []

    class Recorder:
        def record_call(self, function: object, args: list[GraphValue]) -> None:
            calls.append((getattr(function, "name", ""), list(args)))

    x, logits = torch.randn(5, 64), torch.randn(5, 8)
    with recording(Recorder()):
        op(x, logits)
    assert [name for name, _ in calls] == ["fused_moe"]
    args = calls[0][1]
    assert args[3] == 5 and isinstance(args[1], Pointer) and args[1].address == x.data_ptr()
    addresses = {arg.address for arg in args if isinstance(arg, Pointer)}
    biases = [b for b in (op.w13_bias, op.w2_bias) if b is not None]
    assert all(b.data_ptr() in addresses for b in biases)


def test_without_the_kernel_s_dtype_it_runs_the_reference() -> None:
    op = _op(4, 2, 32, 16, torch.float64, True, seed=8)
    assert op.panels() is None
    assert not op.capture_support(CaptureContext(kind=GraphKind.CPU_STEP_GRAPH)).ok
    x, logits = torch.randn(3, 32, dtype=torch.float64), torch.randn(3, 4)
    assert torch.equal(op(x, logits), FusedMoEOp.forward_native(op, x, logits))


class _FutureOption(CpuFusedMoE):
    """An instance with an option the native call does not know (a later SDK's)."""

    def extra_options(self) -> dict[str, object]:
        return {**super().extra_options(), "future_option": True}


def test_an_option_the_call_lacks_runs_the_reference_unrecorded() -> None:
    gen = torch.Generator().manual_seed(9)
    op = _FutureOption(4, 2, 32, 16, dtype=torch.float32, dispatch_key="cpu", bias=True)
    for param in op.parameters():
        param.data.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    op.process_weights_after_loading()
    assert "future_option" not in IMPLEMENTED and op.unimplemented() == ["future_option"]
    assert op.panels() is None and not any(name in dict(op.named_buffers())
                                           for name in PANEL_NAMES)
    answer = op.capture_support(CaptureContext(kind=GraphKind.CPU_STEP_GRAPH))
    assert not answer.ok and "does not implement the experts' future_option" in answer.reason
    x, logits = torch.randn(3, 32), torch.randn(3, 4)
    assert torch.equal(op(x, logits), FusedMoEOp.forward_native(op, x, logits))


def test_the_library_refuses_what_it_would_misread() -> None:
    assert KERNELS is not None
    op = _op(4, 2, 32, 16, torch.float32, True, seed=9)
    panels = op.panels()
    out = torch.empty(3, 32)
    with pytest.raises(ValueError, match="router logits"):
        KERNELS.fused_moe(torch.randn(3, 32), torch.randn(3, 4, dtype=torch.float64), 2, True,
                          op.w13, op.w2, panels, out)
    with pytest.raises(ValueError, match="5 logits per token"):
        KERNELS.fused_moe(torch.randn(3, 32), torch.randn(3, 5), 2, True, op.w13, op.w2,
                          panels, out)
    with pytest.raises(ValueError, match="top_k 5 for 4 experts"):
        KERNELS.fused_moe(torch.randn(3, 32), torch.randn(3, 4), 5, True, op.w13, op.w2,
                          panels, out)
    with pytest.raises(ValueError, match="activation 'gelu' is not supported; supported: "
                                         "silu, swigluoai"):
        KERNELS.fused_moe(torch.randn(3, 32), torch.randn(3, 4), 2, True, op.w13, op.w2,
                          panels, out, activation="gelu")
    with pytest.raises(ValueError, match="w2_bias as a contiguous torch.float32 CPU tensor "
                                         "of 128 elements"):
        KERNELS.fused_moe(torch.randn(3, 32), torch.randn(3, 4), 2, True, op.w13, op.w2,
                          panels, out, biases=(torch.zeros(4, 32), torch.zeros(4, 16)))
