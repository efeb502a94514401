"""The built-in Gemma 3, text only (``engine.core.model_executor.models.gemma3``), end to end.

On engine.testing's tiny random Gemma 3 (kind ``gemma3``: 4 layers, sliding, sliding,
global, sliding, a window of 8 tokens that the longer prompts (34 and 37 tokens) outgrow;
rope per layer type, the global layers' with linear scaling; per-head q/k norms;
``1 + weight`` norms of random weights; ``query_pre_attn_scalar`` 24 where ``head_dim`` is
32; tied embeddings), in float32 on the default CPU attention backend: the prompt's logits
are transformers' within 1e-4 and the greedy tokens equal, alone and with chunked prefill,
prefix-cache hits and preemption, every block free after each; two tensor-parallel ranks
on the ``mp`` executor give one rank's tokens. In bfloat16 the prompt's logits stay near
transformers' bfloat16 ones and the first tokens follow float32 transformers, and the
CPU step graph records the pass (engine-kernels' ``gelu_and_mul`` is a native call) and
gives the eager pass's tokens; with the built-in ``gelu_and_mul`` (torch ops, which a
step graph cannot record) the model runs eagerly, saying why. Which class serves the
architecture: the engine's, unless a plugin registers one. What it does not serve (the
multimodal Gemma 3, bidirectional attention, another activation) is refused when built,
naming it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from engine.core.model_executor.models.gemma2 import GemmaMLP
from engine.core.model_executor.models.gemma3 import Gemma3Attention, Gemma3ForCausalLM
from engine.core.model_selection import choose_model
from engine.core.plugins import PluginCatalog
from engine.kernels.cpu.native import native_kernels
from engine.sdk.groups import MODELS
from engine.sdk.model import ModelContext
from engine.testing.model_checks import SCENARIOS, ModelChecks
from engine.testing.models import build_tiny_checkpoint
from engine.testing.test_plugins import entry_installer

ARCH = "Gemma3ForCausalLM"


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "gemma3", "gemma3")


@pytest.fixture(scope="module")
def checks(tiny_gemma3: Path) -> ModelChecks:
    return ModelChecks(tiny_gemma3, Gemma3ForCausalLM)


def test_the_engine_serves_gemma3_and_a_plugin_takes_precedence(
        checks: ModelChecks, monkeypatch: pytest.MonkeyPatch) -> None:
    choice = choose_model(PluginCatalog.discover(), [ARCH])
    assert choice.entry.distribution == "engine-core" and choice.entry.value == checks.by_path

    class PluginGemma3(Gemma3ForCausalLM):
        """A third party's Gemma 3 (a subclass is enough to tell them apart)."""

    entry_installer(monkeypatch, "acme-engine-plugins", "0.3.0")(MODELS, ARCH, PluginGemma3)
    catalog = PluginCatalog.discover()
    assert choose_model(catalog, [ARCH]).entry.distribution == "acme-engine-plugins"
    assert choose_model(catalog, [ARCH], "engine").entry.value == checks.by_path


def test_prompt_logits_and_greedy_tokens_equal_transformers(checks: ModelChecks) -> None:
    model = checks.logits_and_greedy_tokens()
    specs = [layer.self_attn.attn.impl.params.spec for layer in model.layers]
    assert [spec.sliding_window for spec in specs] == [8, 8, None, 8]


def test_an_untied_head_keeps_its_own_weight_and_the_final_norm_its_own(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Untied: the table is kept as stored (the layer scales its rows), the head its own."""
    path = build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "gemma3-untied", "gemma3",
                                 tie_word_embeddings=False)
    from safetensors.torch import load_file

    model = ModelChecks(path, Gemma3ForCausalLM).logits_and_greedy_tokens()
    stored = load_file(path / "model.safetensors")
    torch.testing.assert_close(model.norm.weight, stored["model.norm.weight"] + 1)
    assert torch.equal(model.embed_tokens.weight, stored["model.embed_tokens.weight"])
    assert model.embed_tokens.scale == 8.0  # sqrt(hidden_size 64)
    assert torch.equal(model.lm_head.weight, stored["lm_head.weight"])


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_engine_gives_the_tokens_of_transformers(checks: ModelChecks, scenario: str) -> None:
    getattr(checks, scenario)()


def test_the_torch_backend_gives_the_tokens_of_transformers(checks: ModelChecks) -> None:
    with checks.llm(attention_backend="torch") as llm:
        assert checks.run(llm) == checks.hf_tokens


def test_bfloat16_follows_transformers(checks: ModelChecks) -> None:
    """bfloat16: logits near transformers' bfloat16 ones, its first greedy tokens float32's.

    The ``1 + weight`` norms round their scale to bfloat16 where transformers multiplies
    in float32 (module docstring of ``models.gemma2``): the logits (about 1 in spread, 6 at
    most) stay within 0.25 of transformers' bfloat16 ones.
    """
    checks.bfloat16_logits(atol=0.25)


def test_the_built_in_gelu_and_mul_keeps_the_model_eager_saying_why(
        checks: ModelChecks, caplog: pytest.LogCaptureFixture) -> None:
    """``--custom-ops -gelu_and_mul``: the reference's torch ops, which no step graph records."""
    native = native_kernels()
    if native is None or torch.bfloat16 not in native.packed_matmul_dtypes:
        pytest.skip("no packed bfloat16 product in this build: the model runs eagerly")
    with caplog.at_level(logging.INFO, logger="engine.core.worker.step_graph"), checks.llm(
            dtype="bfloat16", block_size=16, num_kv_blocks=32, max_num_batched_tokens=64,
            custom_ops=("-gelu_and_mul",)) as llm:
        assert llm.llm_engine.core.worker.model_runner.step_graph is None
    said = [r.getMessage() for r in caplog.records if "CPU step graph" in r.getMessage()]
    assert said and "gelu_and_mul" in said[0], said


class _Layers:
    """A layer factory stand-in that records the rope settings each layer asks for."""

    def __init__(self) -> None:
        self.ropes: list[dict[str, Any]] = []

    def __getattr__(self, name: str) -> Any:
        def build(*args: Any, **kwargs: Any) -> Any:
            if name == "rotary_embedding":
                self.ropes.append(dict(args[3]))
            return SimpleNamespace(output_partition_sizes=(128, 64, 64))
        return build


def test_a_transformers_4_config_gives_the_sliding_layers_their_local_rope_base() -> None:
    config = SimpleNamespace(
        num_hidden_layers=1, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6, sliding_window=8,
        query_pre_attn_scalar=24, rope_theta=1e6, rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    )
    layers = _Layers()
    Gemma3Attention(config, layers, "a", "sliding_attention")  # type: ignore[arg-type]
    Gemma3Attention(config, layers, "b", "full_attention")  # type: ignore[arg-type]
    assert layers.ropes == [{"rope_type": "default", "rope_theta": 1e4},
                            {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}]
    config.sliding_window_pattern = 3
    config.num_hidden_layers = 6
    assert Gemma3ForCausalLM.layer_types(None, config) == [  # type: ignore[arg-type]
        "sliding_attention", "sliding_attention", "full_attention"] * 2


@pytest.mark.parametrize(("changes", "message"), [
    ({"text_config": {}, "vision_config": {}, "model_type": "gemma3"}, "text-only"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
], ids=["multimodal", "bidirectional"])
def test_what_it_does_not_serve_is_refused_by_name(
        tiny_gemma3: Path, changes: dict[str, Any], message: str) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_gemma3)
    for key, value in changes.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=message):
        Gemma3ForCausalLM(ModelContext(hf_config=config, layers=None))


def test_an_activation_other_than_gelu_is_refused_naming_the_supported_ones() -> None:
    config = SimpleNamespace(hidden_activation="relu", hidden_size=64, intermediate_size=128)
    with pytest.raises(ValueError, match="'relu' is not supported; supported: "
                                         "gelu_pytorch_tanh, gelu"):
        GemmaMLP(config, _Layers(), "model.layers.0.mlp")  # type: ignore[arg-type]
