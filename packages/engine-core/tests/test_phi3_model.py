"""The built-in Phi-3 (``engine.core.model_executor.models.phi3``) end to end.

Two tiny random Phi-3 checkpoints (``engine.testing.models``, kind ``phi3``: fused
``qkv_proj`` and ``gate_up_proj`` tensors, grouped-query attention), in float32:

* ``partial``: ``partial_rotary_factor`` 0.75 (12 of 16 elements of each head rotate) and
  tied embeddings, as Phi-4-mini;
* ``window``: ``sliding_window`` 8 on every layer, so the longer prompts (17 to 50 tokens)
  see only their last 8 keys, as Phi-3-mini's 2047.

For each: the prompt's logits are transformers' within 1e-4 and the greedy tokens equal,
alone and with chunked prefill, prefix-cache hits and preemption, every block free after
each; two tensor-parallel ranks on the ``mp`` executor give one rank's tokens (each rank
cuts its part of q, k, v and of gate, up out of the fused checkpoint tensors); bfloat16 on
the default CPU path is recorded as a step graph. The 128k checkpoints' ``longrope`` (also
``su``) builds; ``test_rope_variants`` checks it against transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.core.model_executor.models.phi3 import Phi3ForCausalLM
from engine.core.model_selection import choose_model
from engine.core.plugins import PluginCatalog
from engine.sdk.groups import MODELS
from engine.sdk.model import ModelContext
from engine.testing.model_checks import PROMPTS, SCENARIOS, ModelChecks
from engine.testing.models import TINY_LLAMA, build_tiny_checkpoint
from engine.testing.test_plugins import entry_installer

ARCH = "Phi3ForCausalLM"
WINDOW = 8

VARIANTS = {
    "partial": {"partial_rotary_factor": 0.75, "tie_word_embeddings": True},
    "window": {"sliding_window": WINDOW},
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny_phi3(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
              ) -> Path:
    name = request.param
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / f"phi3-{name}", "phi3",
                                 **VARIANTS[name])


@pytest.fixture(scope="module")
def checks(tiny_phi3: Path) -> ModelChecks:
    return ModelChecks(tiny_phi3, Phi3ForCausalLM)


def test_the_engine_serves_phi3_and_a_plugin_takes_precedence(
        monkeypatch: pytest.MonkeyPatch) -> None:
    by_path = f"{Phi3ForCausalLM.__module__}:{Phi3ForCausalLM.__qualname__}"
    choice = choose_model(PluginCatalog.discover(), [ARCH])
    assert choice.entry.distribution == "engine-core" and choice.entry.value == by_path

    class PluginPhi3(Phi3ForCausalLM):
        """A third party's Phi-3 (a subclass is enough to tell them apart)."""

    entry_installer(monkeypatch, "acme-engine-plugins", "0.3.0")(MODELS, ARCH, PluginPhi3)
    catalog = PluginCatalog.discover()
    assert choose_model(catalog, [ARCH]).entry.distribution == "acme-engine-plugins"
    assert choose_model(catalog, [ARCH], "engine").entry.value == by_path


@pytest.mark.parametrize("rope_scaling", [
    {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8,
     "original_max_position_embeddings": 64},
    {"type": "su", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8},
], ids=["longrope", "su"])
def test_long_rope_configs_are_served(rope_scaling: dict[str, Any]) -> None:
    """The 128k checkpoints' scaling builds (test_rope_variants: against transformers)."""
    import math
    from types import SimpleNamespace

    import torch

    from engine.core.attention import TorchAttentionBackend
    from engine.core.model_executor.layers import LayerFactory

    config = SimpleNamespace(**TINY_LLAMA, original_max_position_embeddings=128,
                             rope_scaling=rope_scaling)
    layers = LayerFactory(dtype=torch.float32, block_size=4,
                          attention_backend=TorchAttentionBackend)
    model = Phi3ForCausalLM(ModelContext(hf_config=config, layers=layers))
    cache = model.layers[0].self_attn.rotary_emb.cos_sin_cache
    # max_position_embeddings 256 > 128: the long factors, and sqrt(1 + ln 2 / ln 128).
    factor = math.sqrt(1 + math.log(256 / 128) / math.log(128))
    assert cache[1, 0].item() == pytest.approx(math.cos(1 / 4.0) * factor, abs=1e-6)


def test_prompt_logits_and_greedy_tokens_equal_transformers(checks: ModelChecks) -> None:
    checks.logits_and_greedy_tokens()  # prompt 1 (37 tokens): past the window of ``window``


def test_the_variant_is_what_the_checkpoint_says(tiny_phi3: Path) -> None:
    """The knobs really are on: else the tests above would prove nothing about them."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_phi3)
    assert config.architectures == [ARCH]
    if tiny_phi3.name.endswith("partial"):
        assert config.rope_parameters["partial_rotary_factor"] == 0.75
        assert config.sliding_window is None
    else:
        assert config.sliding_window == WINDOW < max(len(p) for p in PROMPTS)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_engine_gives_the_tokens_of_transformers(checks: ModelChecks, scenario: str) -> None:
    # two_ranks: each rank cuts its q, k, v (and gate, up) from the fused tensors.
    getattr(checks, scenario)()

