"""The built-in Qwen3-MoE (``engine.core.model_executor.models.qwen3_moe``) end to end.

On a tiny random Qwen3-MoE (3 layers: 6 SwiGLU experts of intermediate size 48, top 2, in
layers 0 and 2, layer 1 dense through ``mlp_only_layers``; Qwen3's per-head q/k norms,
``head_dim`` 32, untied head), in float32: the checkpoint transformers writes holds the
per-expert names the fused layer loads; the prompt's logits are transformers' within 1e-4
and the greedy tokens equal, with ``norm_topk_prob`` on and off, alone and with chunked
prefill, prefix-cache hits and preemption, every block free after each; two
tensor-parallel ranks on the ``mp`` executor (each expert's intermediate size split) give
one rank's tokens; in bfloat16 the CPU step graph records the model (engine-kernels'
``fused_moe`` is one native call per layer) and gives the eager pass's tokens. The layers
that are sparse follow transformers' rule (``mlp_only_layers``, ``decoder_sparse_step``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.core.model_executor.layers.builtin_ops import FusedMoE
from engine.core.model_executor.models.llama import LlamaMLP
from engine.core.model_executor.models.qwen3_moe import (
    Qwen3MoeForCausalLM,
    Qwen3MoeSparseMoeBlock,
    is_sparse_layer,
)
from engine.testing.model_checks import SCENARIOS, ModelChecks

BY_PATH = f"{Qwen3MoeForCausalLM.__module__}:{Qwen3MoeForCausalLM.__qualname__}"


def _checks(checkpoint: Path) -> ModelChecks:
    # Selected by class path: the engine.models entry may not be installed yet.
    checks = ModelChecks(checkpoint, Qwen3MoeForCausalLM)
    checks.options = {**checks.options, "model_impl": BY_PATH}
    return checks


def _default_op() -> str:
    """The CPU's default ``fused_moe``: engine-kernels' native call where it builds.

    By name: the plugin loader may import the entry's module a second time.
    """
    from engine.kernels.cpu.native import native_kernels
    from engine.kernels.ops import FusedMoE as KernelsFusedMoE

    return _name(KernelsFusedMoE if native_kernels() is not None else FusedMoE)


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@pytest.fixture(scope="module")
def checks(tiny_qwen3_moe: Path) -> ModelChecks:
    return _checks(tiny_qwen3_moe)


def test_transformers_writes_the_per_expert_names_the_loader_takes(tiny_qwen3_moe: Path
                                                                   ) -> None:
    from safetensors import safe_open

    with safe_open(str(tiny_qwen3_moe / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    config = json.loads((tiny_qwen3_moe / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["norm_topk_prob"]
    for layer in (0, 2):
        prefix = f"model.layers.{layer}.mlp"
        assert f"{prefix}.gate.weight" in names
        for j in range(6):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert f"{prefix}.experts.{j}.{proj}.weight" in names
        assert not any(n.startswith(f"{prefix}.experts.") and n.count(".") == 5
                       for n in names)  # no fused experts.gate_up_proj
    assert {f"model.layers.1.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")
            } <= names
    assert not any(n.startswith("model.layers.1.mlp.experts.") for n in names)


@pytest.mark.parametrize(("mlp_only", "step"), [([1], 1), ([], 2), ([0, 3], 2), ([], 1)])
def test_sparse_layers_follow_transformers(mlp_only: list[int], step: int) -> None:
    import torch
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer

    config = Qwen3MoeConfig(hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                            num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=8, vocab_size=32, num_experts=4, num_experts_per_tok=2,
                            mlp_only_layers=mlp_only, decoder_sparse_step=step)
    with torch.device("meta"):
        hf = [Qwen3MoeDecoderLayer(config, i) for i in range(4)]
    expected = [hasattr(layer.mlp, "experts") for layer in hf]
    assert [is_sparse_layer(config, i) for i in range(4)] == expected


def test_prompt_logits_and_greedy_tokens_equal_transformers(checks: ModelChecks) -> None:
    model = checks.logits_and_greedy_tokens()
    sparse, dense = model.layers[0].mlp, model.layers[1].mlp
    assert type(sparse) is Qwen3MoeSparseMoeBlock and type(model.layers[2].mlp) is type(sparse)
    assert type(dense) is LlamaMLP
    assert _name(type(sparse.experts.op)) == _default_op() and sparse.experts.op.renormalize
    assert sparse.experts.op.w13.shape == (6, 2 * 48, 64)
    assert sparse.experts.op.w2.shape == (6, 64, 48)


def test_without_norm_topk_prob(tmp_path_factory: pytest.TempPathFactory) -> None:
    from engine.testing.models import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "qwen3_moe_plain",
                                 "qwen3_moe", seed=1, norm_topk_prob=False)
    model = _checks(path).logits_and_greedy_tokens()
    assert not model.layers[0].mlp.experts.op.renormalize


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_engine_gives_the_tokens_of_transformers(checks: ModelChecks, scenario: str) -> None:
    getattr(checks, scenario)()  # two_ranks: each expert's intermediate size is split
