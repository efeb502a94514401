"""The built-in Gemma 2 (``engine.core.model_executor.models.gemma2``) end to end.

Two tiny random Gemma 2 checkpoints (``engine.testing.models``, kind ``gemma2``: 4
layers, the even ones sliding with a window of 8 tokens that the longer prompts (34 and
37 tokens) outgrow; ``1 + weight`` norms of random weights; ``query_pre_attn_scalar`` 24
where ``head_dim`` is 32; tied embeddings; the final logits soft-capped at 4, about what
the largest reach), in float32 on the default CPU attention backend:

* ``final_cap``: no attention soft cap;
* ``attn_cap``: the attention scores soft-capped at 2 too (their spread is about that),
  through ``layers.attention(..., logits_soft_cap=...)``.

For each: the prompt's logits are transformers' within 1e-4 and the greedy tokens equal,
alone and with chunked prefill, prefix-cache hits and preemption, every block free after
each; two tensor-parallel ranks on the ``mp`` executor give one rank's tokens. In bfloat16
the prompt's logits stay near transformers' bfloat16 ones and the first tokens follow
float32 transformers; the CPU step graph records the pass (engine-kernels'
``gelu_and_mul`` is a native call) and gives the eager pass's tokens. The caps matter:
without them the logits are others. Bidirectional attention is refused when built.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.core.model_executor.models.gemma2 import Gemma2ForCausalLM
from engine.core.model_selection import choose_model
from engine.core.plugins import PluginCatalog
from engine.sdk.groups import MODELS
from engine.sdk.model import ModelContext
from engine.testing.model_checks import SCENARIOS, ModelChecks
from engine.testing.models import build_tiny_checkpoint
from engine.testing.test_plugins import entry_installer

ARCH = "Gemma2ForCausalLM"

VARIANTS = {
    "final_cap": {"attn_logit_softcapping": None},
    "attn_cap": {},
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny_gemma2(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                ) -> Path:
    name = request.param
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / f"gemma2-{name}", "gemma2",
                                 **VARIANTS[name])


@pytest.fixture(scope="module")
def checks(tiny_gemma2: Path) -> ModelChecks:
    return ModelChecks(tiny_gemma2, Gemma2ForCausalLM)


def test_the_engine_serves_gemma2_and_a_plugin_takes_precedence(
        monkeypatch: pytest.MonkeyPatch) -> None:
    by_path = f"{Gemma2ForCausalLM.__module__}:{Gemma2ForCausalLM.__qualname__}"
    choice = choose_model(PluginCatalog.discover(), [ARCH])
    assert choice.entry.distribution == "engine-core" and choice.entry.value == by_path

    class PluginGemma2(Gemma2ForCausalLM):
        """A third party's Gemma 2 (a subclass is enough to tell them apart)."""

    entry_installer(monkeypatch, "acme-engine-plugins", "0.3.0")(MODELS, ARCH, PluginGemma2)
    catalog = PluginCatalog.discover()
    assert choose_model(catalog, [ARCH]).entry.distribution == "acme-engine-plugins"
    assert choose_model(catalog, [ARCH], "engine").entry.value == by_path


def test_prompt_logits_and_greedy_tokens_equal_transformers(checks: ModelChecks) -> None:
    model = checks.logits_and_greedy_tokens()
    specs = [layer.self_attn.attn.impl.params.spec for layer in model.layers]
    assert [spec.sliding_window for spec in specs] == [8, None, 8, None]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_engine_gives_the_tokens_of_transformers(checks: ModelChecks, scenario: str) -> None:
    getattr(checks, scenario)()


def test_bfloat16_follows_transformers(checks: ModelChecks) -> None:
    checks.bfloat16_logits(atol=0.25)


def test_the_soft_caps_matter(tiny_gemma2: Path, tmp_path: Path) -> None:
    """The same weights without a cap give other logits than transformers (with it)."""
    import json
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    config = json.loads((tiny_gemma2 / "config.json").read_text())
    uncapped = tmp_path / "uncapped"
    shutil.copytree(tiny_gemma2, uncapped)
    caps = [k for k in ("attn_logit_softcapping", "final_logit_softcapping") if config[k]]
    for key in caps:
        (uncapped / "config.json").write_text(json.dumps({**config, key: None}))
        prompt = torch.tensor([list(range(40, 77))])
        logits = {}
        for path in (tiny_gemma2, uncapped):
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            with torch.inference_mode():
                logits[path] = hf(prompt).logits[0]
        assert (logits[tiny_gemma2] - logits[uncapped]).abs().max() > 0.05, key


def test_bidirectional_attention_is_refused_by_name(tiny_gemma2: Path) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_gemma2)
    config.use_bidirectional_attention = True
    with pytest.raises(ValueError, match="use_bidirectional_attention is not supported"):
        Gemma2ForCausalLM(ModelContext(hf_config=config, layers=None))
