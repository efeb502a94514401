"""The built-in Mixtral (``engine.core.model_executor.models.mixtral``) end to end.

On a tiny random Mixtral (2 layers of 4 SwiGLU experts, top 2, untied head), in float32:
the prompt's logits are transformers' within 1e-4 and the greedy tokens equal, alone and
with chunked prefill, prefix-cache hits and preemption, every block free after each; two
tensor-parallel ranks on the ``mp`` executor (each expert's intermediate size split) give
one rank's tokens; the experts run the ``fused_moe`` custom op, which a plugin replaces;
engine-kernels' op (one native call per layer) lets the CPU step graph record the model,
in bfloat16 too, where the built-in reference keeps it eager, saying why.
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
def checks(tiny_mixtral: Path) -> ModelChecks:
    return ModelChecks(tiny_mixtral, MixtralForCausalLM)


def test_the_engine_serves_mixtral(checks: ModelChecks) -> None:
    choice = choose_model(PluginCatalog.discover(), [ARCH])
    assert choice.entry.distribution == "engine-core" and choice.entry.value == checks.by_path


def test_prompt_logits_and_greedy_tokens_equal_transformers(checks: ModelChecks) -> None:
    model = checks.logits_and_greedy_tokens()
    experts = model.layers[0].mlp.experts
    assert _name(type(experts.op)) == _default_op()
    assert experts.op.w13.shape == (4, 2 * 96, 64) and experts.op.w2.shape == (4, 64, 96)


@pytest.mark.parametrize("scenario", SCENARIOS)
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


def test_engine_kernels_op_is_recorded_and_the_built_in_keeps_the_graph_off(
        checks: ModelChecks, caplog: pytest.LogCaptureFixture) -> None:
    """engine-kernels' op (the default on the CPU) is one native call the step graph
    records; the built-in reference (``-fused_moe``) keeps the model eager, saying why."""
    from engine.kernels.cpu.native import native_kernels

    native = native_kernels()
    if native is None or torch.float32 not in native.packed_matmul_dtypes:
        pytest.skip("no packed float32 product in this build: every model runs eagerly")
    with caplog.at_level(logging.INFO, logger="engine.core.worker.step_graph"):
        with checks.llm(plugins=None) as llm:
            op = checks.model_of(llm).layers[0].mlp.experts.op
            assert type(op).__module__.startswith("engine.kernels.")
            assert llm.llm_engine.core.worker.model_runner.step_graph is not None
            assert checks.run(llm) == checks.hf_tokens
        with checks.llm(plugins=None, custom_ops=["-fused_moe"]) as llm:
            assert type(checks.model_of(llm).layers[0].mlp.experts.op) is FusedMoE
            assert llm.llm_engine.core.worker.model_runner.step_graph is None
            assert checks.run(llm) == checks.hf_tokens
    lines = [r.message for r in caplog.records if "CPU step graph" in r.message]
    assert len(lines) == 2, lines
    assert "native calls" in lines[0] and "not used" not in lines[0]
    assert "not used, the model runs eagerly" in lines[1]
    assert "custom op 'fused_moe'" in lines[1] and "no graph can record" in lines[1]
