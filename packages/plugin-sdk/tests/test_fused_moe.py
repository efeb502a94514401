"""``fused_moe``: the reference against a naive per-token loop, routing rules, replacement.

Also the GPT-OSS options: the clamped ``swigluoai`` activation and the experts' biases.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.sdk import PlatformInfo
from engine.sdk.capture import CaptureContext, GraphKind
from engine.sdk.ops import BUILTIN_OPS, FusedMoEOp, SiluAndMulOp, check_replacement

E, K, H, INTER = 8, 2, 32, 24


def make_op(renormalize: bool = True, dtype: torch.dtype = torch.float32,
            top_k: int = K) -> FusedMoEOp:
    torch.manual_seed(0)
    op = FusedMoEOp(E, top_k, H, INTER, renormalize=renormalize, dtype=dtype)
    with torch.no_grad():
        op.w13.copy_(torch.randn(E, 2 * INTER, H) * 0.2)
        op.w2.copy_(torch.randn(E, H, INTER) * 0.2)
    return op


def naive(op: FusedMoEOp, hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per token, per chosen expert, in float64: the docstring's loop, written plainly."""
    out = torch.zeros(hidden.shape[0], op.hidden_size, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        probs = torch.softmax(logits[t].double(), -1)
        chosen = sorted(range(op.num_experts), key=lambda e: -float(probs[e]))[:op.top_k]
        total = sum(float(probs[e]) for e in chosen)
        for e in chosen:
            weight = float(probs[e]) / total if op.renormalize else float(probs[e])
            x = hidden[t].double()
            gate_up = op.w13[e].double() @ x
            if op.w13_bias is not None:
                gate_up = gate_up + op.w13_bias[e].double()
            gate, up = gate_up[:op.intermediate_size], gate_up[op.intermediate_size:]
            if op.activation == "silu":
                a = F.silu(gate) * up
            else:  # swigluoai, as transformers' GptOssExperts._apply_gate writes it
                gate = gate.clamp(min=None, max=op.swiglu_limit)
                up = up.clamp(min=-op.swiglu_limit, max=op.swiglu_limit)
                a = (up + 1) * (gate * torch.sigmoid(gate * op.swiglu_alpha))
            down = op.w2[e].double() @ a
            if op.w2_bias is not None:
                down = down + op.w2_bias[e].double()
            out[t] += weight * down
    return out


@pytest.mark.parametrize(("activation", "bias"),
                         [("swigluoai", True), ("swigluoai", False), ("silu", True)])
def test_swigluoai_and_biases_equal_a_per_token_loop(activation: str, bias: bool) -> None:
    torch.manual_seed(1)
    op = FusedMoEOp(E, K, H, INTER, activation=activation,  # type: ignore[arg-type]
                    swiglu_alpha=1.702, swiglu_limit=1.0, bias=bias)
    with torch.no_grad():
        for param in op.parameters():
            param.copy_(torch.randn(param.shape) * 0.5)  # gate and up reach the clamps
    assert (op.w13_bias is not None) is bias and (op.w2_bias is not None) is bias
    expected_options: dict[str, object] = {"bias": True} if bias else {}
    if activation == "swigluoai":
        expected_options.update(activation="swigluoai", swiglu_alpha=1.702, swiglu_limit=1.0)
    assert op.extra_options() == expected_options
    hidden, logits = torch.randn(9, H), torch.randn(9, E) * 3
    gate_up = torch.einsum("th,eih->tei", hidden, op.w13)
    assert gate_up[..., :INTER].max() > 1 and gate_up[..., INTER:].abs().max() > 1
    torch.testing.assert_close(op(hidden, logits).double(), naive(op, hidden, logits),
                               atol=1e-5, rtol=1e-5)


def test_plain_options_and_bad_options() -> None:
    op = make_op()
    assert op.extra_options() == {} and op.activation == "silu" and not op.has_bias
    assert op.w13_bias is None and op.w2_bias is None
    assert {name for name, _ in op.named_parameters()} == {"w13", "w2"}
    with pytest.raises(ValueError, match="activation 'gelu' is not supported; supported: "
                                         "silu, swigluoai"):
        FusedMoEOp(E, K, H, INTER, activation="gelu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="swiglu_limit must be positive, got -1"):
        FusedMoEOp(E, K, H, INTER, activation="swigluoai", swiglu_limit=-1.0)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_the_reference_equals_a_per_token_loop(renormalize: bool, tokens: int) -> None:
    op = make_op(renormalize)
    generator = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(tokens, H, generator=generator)
    logits = torch.randn(tokens, E, generator=generator) * 3
    out = op(hidden, logits)
    assert out.shape == (tokens, H) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), naive(op, hidden, logits), atol=1e-5, rtol=1e-5)


def test_renormalize_is_top_k_then_softmax() -> None:
    op = make_op(True)
    logits = torch.randn(16, E) * 2
    weights, ids = op.route(logits)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    torch.testing.assert_close(weights.sum(-1), torch.ones(16))
    top_logits, top_ids = torch.topk(logits, K, -1)
    assert torch.equal(ids, top_ids)
    torch.testing.assert_close(weights, torch.softmax(top_logits, -1))
    plain, _ = make_op(False).route(logits)
    torch.testing.assert_close(plain, torch.softmax(logits, -1).gather(1, ids))


def test_one_expert_per_token_and_every_expert() -> None:
    hidden = torch.randn(5, H)
    logits = torch.randn(5, E)
    for top_k in (1, E):
        op = make_op(top_k=top_k)
        torch.testing.assert_close(op(hidden, logits).double(), naive(op, hidden, logits),
                                   atol=1e-5, rtol=1e-5)


def test_no_tokens_and_unused_experts() -> None:
    op = make_op()
    assert op(torch.zeros(0, H), torch.zeros(0, E)).shape == (0, H)
    logits = torch.full((3, E), -10.0)
    logits[:, 2] = logits[:, 5] = 10.0  # only experts 2 and 5 are used
    hidden = torch.randn(3, H)
    torch.testing.assert_close(op(hidden, logits).double(), naive(op, hidden, logits),
                               atol=1e-5, rtol=1e-5)


def test_bfloat16_follows_the_float32_reference() -> None:
    op32, op16 = make_op(), make_op(dtype=torch.bfloat16)
    hidden = torch.randn(9, H)
    logits = torch.randn(9, E) * 3
    out = op16(hidden.bfloat16(), logits)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), op32(hidden, logits), atol=3e-2, rtol=3e-2)


def test_inputs_are_not_modified_and_the_op_is_the_sum_of_intermediate_shards() -> None:
    """Split each expert's intermediate dimension in two: the two partial sums add up."""
    op = make_op()
    hidden, logits = torch.randn(6, H), torch.randn(6, E)
    kept = hidden.clone(), logits.clone()
    whole = op(hidden, logits)
    assert torch.equal(hidden, kept[0]) and torch.equal(logits, kept[1])
    halves = []
    for part in range(2):
        shard = FusedMoEOp(E, K, H, INTER // 2)
        rows = slice(part * INTER // 2, (part + 1) * INTER // 2)
        with torch.no_grad():
            shard.w13.copy_(torch.cat((op.w13[:, :INTER][:, rows], op.w13[:, INTER:][:, rows]), 1))
            shard.w2.copy_(op.w2[:, :, rows])
        halves.append(shard(hidden, logits))
    torch.testing.assert_close(halves[0] + halves[1], whole, atol=1e-5, rtol=1e-5)


def test_it_is_a_built_in_contract_with_a_checked_replacement() -> None:
    assert BUILTIN_OPS["fused_moe"] is FusedMoEOp and FusedMoEOp.name == "fused_moe"

    class MyMoE(FusedMoEOp):
        def forward_cpu(self, hidden: torch.Tensor, router_logits: torch.Tensor
                        ) -> torch.Tensor:
            return self.forward_native(hidden, router_logits)

    class NotMoE(SiluAndMulOp):
        name = "fused_moe"

    assert check_replacement("fused_moe", MyMoE)
    refused = check_replacement("fused_moe", NotMoE)
    assert not refused and "does not subclass engine.sdk.ops.FusedMoEOp" in refused.reason
    cpu = PlatformInfo("cpu", "cpu")
    assert MyMoE.is_supported(cpu) and not FusedMoEOp.is_supported(cpu)
    op = MyMoE(E, K, H, INTER, dispatch_key="cpu")
    assert op.method_for(op.dispatch_key) == "forward_cpu"
    assert not op.capture_support(CaptureContext(kind=GraphKind.CPU_STEP_GRAPH))


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="top_k must be in"):
        FusedMoEOp(4, 5, H, INTER)
    with pytest.raises(ValueError, match="must be positive"):
        FusedMoEOp(4, 2, H, 0)
