"""The built-in Qwen3 (``engine.core.model_executor.models.qwen3``) end to end.

On engine.testing's tiny random Qwen3 (per-head q/k norms of random weights, ``head_dim`` 32
where ``hidden_size / num_attention_heads`` is 16, untied head), in float32: the prompt's
logits are transformers' within 1e-4 and the greedy tokens equal, alone and with chunked
prefill, prefix-cache hits and preemption, every block free after each; two tensor-parallel
ranks on the ``mp`` executor give one rank's tokens; bfloat16 on the default CPU path is
recorded as a step graph. Which class serves the architecture: the engine's, unless a
plugin registers one (``--model-impl``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.core.model_executor.models.qwen3 import Qwen3ForCausalLM
from engine.core.model_selection import choose_model
from engine.core.plugins import PluginCatalog
from engine.sdk.groups import MODELS
from engine.testing.model_checks import SCENARIOS, ModelChecks
from engine.testing.test_plugins import entry_installer

ARCH = "Qwen3ForCausalLM"


@pytest.fixture(scope="module")
def checks(tiny_qwen3: Path) -> ModelChecks:
    return ModelChecks(tiny_qwen3, Qwen3ForCausalLM)


def test_the_engine_serves_qwen3_and_a_plugin_takes_precedence(
        checks: ModelChecks, monkeypatch: pytest.MonkeyPatch) -> None:
    choice = choose_model(PluginCatalog.discover(), [ARCH])
    assert choice.entry.distribution == "engine-core" and choice.entry.value == checks.by_path

    class PluginQwen3(Qwen3ForCausalLM):
        """A third party's Qwen3 (a subclass is enough to tell them apart)."""

    entry_installer(monkeypatch, "acme-engine-plugins", "0.3.0")(MODELS, ARCH, PluginQwen3)
    catalog = PluginCatalog.discover()
    assert choose_model(catalog, [ARCH]).entry.distribution == "acme-engine-plugins"
    assert choose_model(catalog, [ARCH], "engine").entry.value == checks.by_path


def test_prompt_logits_and_greedy_tokens_equal_transformers(checks: ModelChecks) -> None:
    checks.logits_and_greedy_tokens()


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_engine_gives_the_tokens_of_transformers(checks: ModelChecks, scenario: str) -> None:
    getattr(checks, scenario)()

