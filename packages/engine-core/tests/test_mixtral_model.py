"""The built-in Mixtral (``engine.core.model_executor.models.mixtral``) end to end.

On a tiny random Mixtral (2 layers of 4 SwiGLU experts, top 2, untied head), in float32:
the prompt's logits are transformers' within 1e-4 and the greedy tokens equal, alone and
with chunked prefill, prefix-cache hits and preemption, every block free after each; two
tensor-parallel ranks on the ``mp`` executor (each expert's intermediate size split) give
one rank's tokens; the experts run the ``fused_moe`` custom op, which a plugin replaces;
the built-in op keeps the model eager on the CPU step graph, saying why.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from engine.core.model_executor.layers.builtin_ops import FusedMoE
from engine.core.model_executor.models.mixtral import MixtralForCausalLM
from engine.core.model_selection import choose_model
from engine.core.plugins import PluginCatalog
from engine.sdk.groups import CUSTOM_OPS
from engine.sdk.ops import FusedMoEOp
from engine.testing.model_checks import SCENARIOS, ModelChecks
from engine.testing.test_plugins import entry_installer

ARCH = "MixtralForCausalLM"


@pytest.fixture(scope="module")
def checks(tiny_mixtral: Path) -> ModelChecks:
    return ModelChecks(tiny_mixtral, MixtralForCausalLM)


def test_the_engine_serves_mixtral(checks: ModelChecks) -> None:
    choice = choose_model(PluginCatalog.discover(), [ARCH])
    assert choice.entry.distribution == "engine-core" and choice.entry.value == checks.by_path


def test_prompt_logits_and_greedy_tokens_equal_transformers(checks: ModelChecks) -> None:
    model = checks.logits_and_greedy_tokens()
    experts = model.layers[0].mlp.experts
    assert type(experts.op) is FusedMoE
    assert experts.op.w13.shape == (4, 2 * 96, 64) and experts.op.w2.shape == (4, 64, 96)


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s != "bfloat16_step_graph"])
def test_the_engine_gives_the_tokens_of_transformers(checks: ModelChecks, scenario: str) -> None:
    getattr(checks, scenario)()  # two_ranks: each expert's intermediate size is split


class CountingFusedMoE(FusedMoEOp):
    """A plugin's ``fused_moe`` with a CPU path of its own: counts its calls."""

    calls: ClassVar[int] = 0

    def forward_cpu(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        return self.forward_native(hidden, router_logits)


def test_a_plugin_replaces_fused_moe(monkeypatch: pytest.MonkeyPatch,
                                     checks: ModelChecks) -> None:
    entry_installer(monkeypatch, "acme-moe", "0.1.0")(CUSTOM_OPS, "fused_moe",
                                                      CountingFusedMoE)
    plugins = "engine-core,acme-moe"
    with checks.llm(plugins=plugins) as llm:
        ops = [layer.mlp.experts.op for layer in checks.model_of(llm).layers]
        # The entry is imported by its path: this module's class, possibly a second copy.
        used = type(ops[0])
        assert used.__qualname__ == "CountingFusedMoE" and issubclass(used, FusedMoEOp)
        assert all(type(op) is used and op.dispatch_key == "cpu" for op in ops)
        used.calls = 0
        assert checks.run(llm) == checks.hf_tokens
    assert used.calls > 0  # reached, and its results are the reference's
    # The operator turns it off: the built-in again, never called.
    used.calls = 0
    with checks.llm(plugins=plugins, custom_ops=["-fused_moe"]) as llm:
        assert type(checks.model_of(llm).layers[0].mlp.experts.op) is FusedMoE
        assert checks.run(llm, checks.prompts[:1]) == checks.hf_tokens[:1]
    assert used.calls == 0


def test_the_built_in_op_keeps_the_cpu_step_graph_off_saying_why(
        checks: ModelChecks, caplog: pytest.LogCaptureFixture) -> None:
    from engine.kernels.cpu.native import native_kernels

    native = native_kernels()
    if native is None or torch.float32 not in native.packed_matmul_dtypes:
        pytest.skip("no packed float32 product in this build: every model runs eagerly")
    with caplog.at_level(logging.INFO, logger="engine.core.worker.step_graph"), checks.llm(
            plugins=None) as llm:
        assert llm.llm_engine.core.worker.model_runner.step_graph is None
        assert checks.run(llm) == checks.hf_tokens
    lines = [r.message for r in caplog.records if "CPU step graph" in r.message]
    assert len(lines) == 1, lines
    assert "not used, the model runs eagerly" in lines[0]
    assert "custom op 'fused_moe'" in lines[0] and "no graph can record" in lines[0]
