"""The built-in GPT-OSS (``engine.core.model_executor.models.gpt_oss``) end to end.

On a tiny random GPT-OSS (4 layers alternating a sliding window of 8 and full attention,
per-head sinks, q/k/v/o biases, YaRN rope, 4 experts of intermediate size 48 with biases
and the clamped SwiGLU, top 2, random biases and sinks), in float32: the checkpoint
transformers writes holds the stacked, interleaved expert tensors the loader rearranges;
one layer's experts (``fused_moe`` with ``activation="swigluoai"`` and ``bias=True``)
equal transformers' ``GptOssMLP``, also as two tensor-parallel halves summed (the down
projection's bias counted once); the prompt's logits are transformers' within 1e-4 and the
greedy tokens equal (on the default and on the ``torch`` attention backend), alone and
with chunked prefill, prefix-cache hits and preemption, every block free after each; two
tensor-parallel ranks on the ``mp`` executor give one rank's tokens; in bfloat16 the first
tokens follow float32 transformers, eagerly and as a CPU step graph (engine-kernels' native
``fused_moe`` implements the experts' options, the ``cpu`` backend the sinks).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.core.distributed import TensorParallelGroup
from engine.core.distributed.sharding import even_slice
from engine.core.model_executor.layers.builtin_ops import FusedMoE
from engine.core.model_executor.layers.fused_moe import MoELayer
from engine.core.model_executor.models.gpt_oss import (
    GptOssForCausalLM,
    GptOssMLP,
    sliding_window_of,
    to_op_layout,
)
from engine.sdk.ops import FusedMoEOp
from engine.testing.model_checks import SCENARIOS, ModelChecks

BY_PATH = f"{GptOssForCausalLM.__module__}:{GptOssForCausalLM.__qualname__}"


@pytest.fixture(scope="module")
def checks(tiny_gpt_oss: Path) -> ModelChecks:
    # Selected by class path: the engine.models entry may not be installed yet.
    checks = ModelChecks(tiny_gpt_oss, GptOssForCausalLM)
    checks.options = {**checks.options, "model_impl": BY_PATH}
    return checks


def test_transformers_writes_stacked_interleaved_experts(tiny_gpt_oss: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(tiny_gpt_oss / "model.safetensors"), "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    config = json.loads((tiny_gpt_oss / "config.json").read_text())
    assert config["architectures"] == ["GptOssForCausalLM"]
    assert config["rope_parameters"]["rope_type"] == "yarn"
    prefix = "model.layers.0.mlp"
    assert shapes[f"{prefix}.experts.gate_up_proj"] == (4, 64, 96)
    assert shapes[f"{prefix}.experts.gate_up_proj_bias"] == (4, 96)
    assert shapes[f"{prefix}.experts.down_proj"] == (4, 48, 64)
    assert shapes[f"{prefix}.experts.down_proj_bias"] == (4, 64)
    assert shapes[f"{prefix}.router.bias"] == (4,)
    assert shapes["model.layers.0.self_attn.sinks"] == (4,)
    assert not any(".experts.0." in name for name in shapes)


def _hf_mlp(seed: int) -> tuple[object, torch.nn.Module]:
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP as HfMLP

    config = GptOssConfig(hidden_size=32, intermediate_size=24, num_local_experts=4,
                          num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=16, vocab_size=32,
                          swiglu_limit=1.5)  # a small limit: both clamps bite
    torch.manual_seed(seed)
    hf = HfMLP(config).eval()
    with torch.no_grad():
        for param in hf.parameters():
            param.normal_(0.0, 0.5)
    return config, hf


def _moe_layer(config: object, hf: torch.nn.Module, rank: int, size: int) -> MoELayer:
    experts = hf.experts  # type: ignore[attr-defined]
    part = even_slice(24, rank, size)
    op = FusedMoE(4, 2, 32, part.size, activation="swigluoai", swiglu_alpha=1.702,
                  swiglu_limit=1.5, bias=True)
    layer = MoELayer(op, "mlp.experts", part, TensorParallelGroup(rank, size))
    for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
        layer.load_weight(name, to_op_layout(name, getattr(experts, name).detach()))
    return layer


def test_swigluoai_experts_with_biases_equal_transformers() -> None:
    config, hf = _hf_mlp(seed=3)
    x = torch.randn(1, 11, 32) * 3  # large enough that gate and up reach the clamps
    with torch.no_grad():
        expected, _ = hf(x)
        logits = torch.nn.functional.linear(x[0], hf.router.weight,  # type: ignore[union-attr]
                                            hf.router.bias)  # type: ignore[union-attr]
    whole = _moe_layer(config, hf, 0, 1)
    assert whole.op.extra_options() == {"activation": "swigluoai", "swiglu_alpha": 1.702,
                                        "swiglu_limit": 1.5, "bias": True}
    torch.testing.assert_close(whole(x[0], logits), expected[0], atol=1e-5, rtol=1e-5)
    # Two tensor-parallel halves: each rank's partial sums add up to the whole (the
    # down projection's bias only on rank 0).
    halves = [_moe_layer(config, hf, rank, 2) for rank in (0, 1)]
    assert halves[1].op.w2_bias is not None and not halves[1].op.w2_bias.any()
    summed = sum(half.op(x[0], logits) for half in halves)
    torch.testing.assert_close(summed, expected[0], atol=1e-5, rtol=1e-5)


def test_the_layer_refuses_biases_it_lacks_and_wrong_stacked_shapes() -> None:
    plain = FusedMoE(4, 2, 8, 6)
    layer = MoELayer(plain, "mlp.experts", even_slice(6, 0, 1))
    with pytest.raises(ValueError, match="without expert biases"):
        layer.load_weight("down_proj_bias", torch.zeros(4, 8))
    with pytest.raises(ValueError, match=r"has shape \(4, 6, 8\), the model expects"):
        layer.load_weight("down_proj", torch.zeros(4, 6, 8))


def test_layer_types_choose_each_layers_window() -> None:
    from transformers import GptOssConfig

    config = GptOssConfig(num_hidden_layers=3, sliding_window=5,
                          layer_types=["full_attention", "sliding_attention",
                                       "full_attention"])
    assert [sliding_window_of(config, i) for i in range(3)] == [None, 5, None]
    config.layer_types = ["full_attention", "chunked_attention", "full_attention"]
    with pytest.raises(ValueError, match="layer_types.1. is 'chunked_attention'"):
        sliding_window_of(config, 1)


def test_prompt_logits_and_greedy_tokens_equal_transformers(checks: ModelChecks) -> None:
    model = checks.logits_and_greedy_tokens()
    mlp = model.layers[0].mlp
    # The CPU's default op (engine-kernels') runs its native call for these options.
    assert type(mlp) is GptOssMLP and isinstance(mlp.experts.op, FusedMoEOp)
    assert mlp.experts.op.activation == "swigluoai" and mlp.experts.op.has_bias
    assert mlp.experts.op.w13.shape == (4, 2 * 48, 64)
    windows = [layer.self_attn.attn.impl.params.spec.sliding_window for layer in model.layers]
    assert windows == [8, None, 8, None]
    assert all(layer.self_attn.attn.sinks is not None for layer in model.layers)


def test_the_torch_backend_gives_transformers_logits(tiny_gpt_oss: Path) -> None:
    # The reference backend: sinks joined to its softmax, each layer its own window.
    checks = ModelChecks(tiny_gpt_oss, GptOssForCausalLM)
    checks.options = {**checks.options, "model_impl": BY_PATH, "attention_backend": "torch"}
    model = checks.logits_and_greedy_tokens()
    assert type(model.layers[0].self_attn.attn.impl).__name__ == "TorchAttentionImpl"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_engine_gives_the_tokens_of_transformers(checks: ModelChecks, scenario: str) -> None:
    # two_ranks: heads, sinks and experts split; bfloat16_step_graph: the whole pass
    # recorded (sinks, biases and the clamped activation in bfloat16), the eager tokens.
    getattr(checks, scenario)()


def test_bfloat16_first_tokens_follow_float32_transformers(checks: ModelChecks) -> None:
    # Eager: sinks, biases and the clamped activation in bfloat16 (also where the build
    # has no packed bfloat16 product and bfloat16_step_graph skips).
    with checks.llm(dtype="bfloat16", block_size=16, num_kv_blocks=32,
                    enforce_eager=True) as llm:
        tokens = checks.run(llm)
    assert [t[:2] for t in tokens] == [t[:2] for t in checks.hf_tokens]
