"""A mixture-of-experts model plugin built through the SDK alone: engine-test-moe-model.

The package (``packages/testing-fixtures/plugins/moe-model``) is pip-installed into a
directory of its own and found through its ``engine.models`` entry, ``Qwen2MoeForCausalLM``:
an architecture engine-core has no model for. Its module imports only ``engine.sdk`` and
torch, and builds every layer through ``ctx.layers`` (the routed experts in
``layers.fused_moe``, the shared expert beside them from ``layers.linear`` and
``layers.silu_and_mul``). On tiny random Qwen2-MoE checkpoints (3 layers, one of them
dense; random q/k/v biases, norms and shared-expert gates), in float32: the prompt's
logits are transformers' within 1e-4 and the greedy tokens equal, with ``norm_topk_prob``
off (Qwen1.5-MoE's) and on, alone and with chunked prefill, prefix-cache hits and
preemption; two tensor-parallel ranks on the ``mp`` executor (each expert's and the shared
expert's intermediate size split) give one rank's tokens. Its ``capture_support`` keeps
the CPU step graph off, saying why.
"""

from __future__ import annotations

import ast
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from engine.core.model_selection import choose_model
from engine.core.plugins import PluginCatalog
from engine.sdk import ModelContext, ValidationError
from engine.sdk.groups import MODELS
from engine.testing.model_checks import SCENARIOS, ModelChecks
from engine.testing.models import TINY_LLAMA, build_tiny_checkpoint
from engine.testing.test_plugins import PLUGINS_SOURCE, install_test_plugins, put_on_path

ARCH = "Qwen2MoeForCausalLM"
DISTRIBUTION = "engine-test-moe-model"
SOURCE = PLUGINS_SOURCE / "moe-model" / "src" / "engine_test_moe_model"


def tiny_qwen2_moe(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """A random Qwen2-MoE: layers 0 and 2 of 6 experts (48 wide, top 2) and a shared expert
    (96 wide), layer 1 dense (``mlp_only_layers``), unless ``overrides`` say otherwise."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    build_tiny_checkpoint(path.parent / f"{path.name}-tokenizer")  # its tokenizer files
    config = Qwen2MoeConfig(**{**TINY_LLAMA, "num_hidden_layers": 3, "num_experts": 6,
                               "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                               "shared_expert_intermediate_size": 96, "mlp_only_layers": [1],
                               "tie_word_embeddings": False, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith((".gate.weight", "shared_expert_gate.weight")):
                param.normal_(0.0, 0.5)  # decisive routing, gates far from one half
            elif param.dim() > 1:
                param.normal_(0.0, 0.08)  # distinct logits: greedy paths are no ties
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)  # q/k/v biases that matter
            else:
                param.uniform_(0.5, 1.5)  # norms that matter
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(path.parent / f"{path.name}-tokenizer" / name, path / name)
    return path


@pytest.fixture(scope="module")
def plugin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModuleType]:
    """engine-test-moe-model pip-installed and discoverable; its model module."""
    target = install_test_plugins(tmp_path_factory.mktemp("moe-site"), ("moe-model",))
    with pytest.MonkeyPatch.context() as monkeypatch:
        put_on_path(target, monkeypatch)
        from engine_test_moe_model import qwen2_moe  # type: ignore[import-not-found]

        yield qwen2_moe


def plugin_checks(checkpoint: Path, plugin: ModuleType) -> ModelChecks:
    checks = ModelChecks(checkpoint, plugin.Qwen2MoeForCausalLM)
    # Only this plugin beside the engine's own; the model is found by its entry point.
    checks.options = {**checks.options, "plugins": DISTRIBUTION}
    return checks


@pytest.fixture(scope="module")
def checks(plugin: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> ModelChecks:
    return plugin_checks(tiny_qwen2_moe(tmp_path_factory.mktemp("tiny") / "qwen2_moe"),
                         plugin)


def test_the_plugin_imports_only_the_sdk_and_torch() -> None:
    standard = {"__future__", "collections", "typing", "torch"}
    for path in SOURCE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert (name.split(".")[0] in standard or name == "engine.sdk"
                        or name.startswith("engine.sdk.")), f"{path.name} imports {name}"


def test_its_entry_serves_an_architecture_the_engine_lacks(plugin: ModuleType) -> None:
    catalog = PluginCatalog.discover()
    candidates = catalog.candidates(MODELS, ARCH)
    assert [e.distribution for e in candidates] == [DISTRIBUTION]  # none of engine-core's
    choice = choose_model(catalog, [ARCH])
    assert choice.entry.distribution == DISTRIBUTION
    assert choice.entry.value == "engine_test_moe_model.qwen2_moe:Qwen2MoeForCausalLM"


def test_prompt_logits_and_greedy_tokens_equal_transformers(
        checks: ModelChecks, plugin: ModuleType, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="engine.core.worker.step_graph"):
        model = checks.logits_and_greedy_tokens()
    sparse, dense = model.layers[0].mlp, model.layers[1].mlp
    assert type(sparse) is plugin.Qwen2MoeSparseMoeBlock
    assert type(model.layers[2].mlp) is type(sparse) and type(dense) is plugin.Qwen2MoeMLP
    op = sparse.experts.op  # built by ctx.layers.fused_moe: the engine's op (engine-kernels')
    assert type(op).__module__.startswith(("engine.core.", "engine.kernels."))
    assert not op.renormalize
    assert op.w13.shape == (6, 2 * 48, 64) and op.w2.shape == (6, 64, 48)
    assert sparse.shared_expert.gate_up_proj.output_partition_sizes == (96, 96)
    # Its capture_support keeps the CPU step graph off, named with its plugin.
    assert ("CPU step graph: not used, the model runs eagerly (model "
            f"engine_test_moe_model.qwen2_moe.Qwen2MoeForCausalLM of plugin '{ARCH}' (group "
            f"engine.models, distribution {DISTRIBUTION} 0.1.0): the shared expert's sigmoid "
            "gate and the expert sums are torch compute)") in caplog.messages


def test_with_norm_topk_prob_tied_head_and_every_other_layer_sparse(
        plugin: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> None:
    path = tiny_qwen2_moe(tmp_path_factory.mktemp("tiny") / "qwen2_moe_norm", seed=1,
                          norm_topk_prob=True, tie_word_embeddings=True, mlp_only_layers=[],
                          decoder_sparse_step=2)
    model = plugin_checks(path, plugin).logits_and_greedy_tokens()
    assert [type(layer.mlp).__name__ for layer in model.layers] == [
        "Qwen2MoeMLP", "Qwen2MoeSparseMoeBlock", "Qwen2MoeMLP"]
    assert model.layers[1].mlp.experts.op.renormalize
    assert model.lm_head.weight is model.embed_tokens.weight


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s != "bfloat16_step_graph"])
def test_the_engine_gives_the_tokens_of_transformers(checks: ModelChecks, scenario: str) -> None:
    # bfloat16_step_graph is left out: the model keeps the CPU step graph off (above).
    getattr(checks, scenario)()  # two_ranks: the experts' and the shared expert's split


def test_it_refuses_what_it_does_not_implement(plugin: ModuleType) -> None:
    from transformers import Qwen2MoeConfig

    model_cls = plugin.Qwen2MoeForCausalLM
    with pytest.raises(ValidationError, match=r"built by the engine \(ctx.layers is None\)"):
        model_cls(ModelContext(hf_config=Qwen2MoeConfig()))
    layers: Any = object()  # refused before any layer is built
    with pytest.raises(ValidationError, match="hidden_act 'silu' only, got 'gelu'"):
        model_cls(ModelContext(hf_config=Qwen2MoeConfig(hidden_act="gelu"), layers=layers))
    with pytest.raises(ValidationError, match="use_sliding_window false only"):
        model_cls(ModelContext(hf_config=Qwen2MoeConfig(use_sliding_window=True),
                               layers=layers))
