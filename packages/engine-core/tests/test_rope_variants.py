"""Scaled rotary variants (``layers.rope``: YaRN, LongRoPE, dynamic NTK) against transformers.

For each type, the cosines and sines of the rotary op the layer factory builds equal those
of transformers' rotary embedding module (the model's ``rotary_emb`` class, so its
``ROPE_INIT_FUNCTIONS`` entry and its attention scaling) on the same config, at positions
below and above ``original_max_position_embeddings``. LongRoPE's factors follow the
engine's ``max_model_len`` (vLLM's rule): short when it is at most the original context,
as transformers does for sequences within it; long when it is more, as transformers does
for a pass that reaches past it. End to end, a tiny Qwen3 with YaRN and a tiny Phi-3 with
LongRoPE (both sets) give transformers' prompt logits and greedy tokens, with prompts past
the original context where it matters.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, Phi3Config, Qwen3Config

from engine.core.attention import TorchAttentionBackend
from engine.core.model_executor.layers import LayerFactory
from engine.core.model_executor.models.phi3 import Phi3ForCausalLM
from engine.core.model_executor.models.qwen3 import Qwen3ForCausalLM
from engine.sdk.layers import rope_settings
from engine.testing.model_checks import ModelChecks
from engine.testing.models import build_tiny_checkpoint

MAX_POSITION = 256
ORIGINAL = 64
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
#: Qwen3's shape (head_dim 32, not hidden / heads).
QWEN3 = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 32, "max_position_embeddings": MAX_POSITION}

YARN_CASES = {
    "qwen3": YARN,
    "gpt_oss": {**YARN, "factor": 32.0, "beta_fast": 16.0, "beta_slow": 2.0,
                "truncate": False},
    "deepseek": {**YARN, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707},
    "attention_factor": {**YARN, "attention_factor": 1.25},
    "implicit_factor": {**YARN, "factor": None},  # max_position / original
}

# Phi-3's shape: head_dim 16 (8 factors), or 12 rotating elements (6) with partial rotary.
PHI3 = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": MAX_POSITION, "original_max_position_embeddings": 32,
        "pad_token_id": 0}
SHORT = [1.0, 1.02, 1.05, 1.1, 1.2, 1.3, 1.5, 1.8]
LONG = [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0]


def longrope(n: int, **extra: Any) -> dict[str, Any]:
    return {"rope_type": "longrope", "short_factor": SHORT[:n], "long_factor": LONG[:n],
            **extra}


def hf_cos_sin(config: Any, positions: range) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``(cos, sin)``, ``[len(positions), rotary_dim / 2]``, of one pass."""
    module: Any
    if isinstance(config, Phi3Config):
        from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding as module
    elif isinstance(config, Qwen3Config):
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding as module
    else:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding as module
    rotary = module(config)
    with torch.no_grad():
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), torch.tensor([list(positions)]))
    half = cos.shape[-1] // 2
    return cos[0, :, :half], sin[0, :, :half]


def engine_cos_sin(config: Any, positions: range, max_model_len: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's ``(cos, sin)`` at ``positions``, from the factory's rotary op."""
    rope = rope_settings(config)
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size
                                                      // config.num_attention_heads)
    rotary_dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    factory = LayerFactory(dtype=torch.float32, block_size=4,
                           attention_backend=TorchAttentionBackend, max_model_len=max_model_len)
    op = factory.rotary_embedding(head_dim, rotary_dim, config.max_position_embeddings, rope)
    cos, sin = op.cos_sin_cache[torch.tensor(list(positions))].chunk(2, dim=-1)
    return cos, sin


def assert_same(engine: tuple[torch.Tensor, torch.Tensor],
                hf: tuple[torch.Tensor, torch.Tensor]) -> None:
    # float32, the same formulas in the same order (equal to the bit on this CPU).
    torch.testing.assert_close(engine[0], hf[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(engine[1], hf[1], atol=1e-6, rtol=0)


@pytest.mark.parametrize("case", list(YARN_CASES))
def test_yarn_equals_transformers_below_and_above_the_original_context(case: str) -> None:
    config = Qwen3Config(**QWEN3, rope_parameters={**YARN_CASES[case], "rope_theta": 1e4})
    positions = range(MAX_POSITION)  # 0..63 within the original context, 64.. beyond
    hf = hf_cos_sin(config, positions)
    assert_same(engine_cos_sin(config, positions), hf)
    assert hf[0].abs().max() > 1.05  # the attention factor is on
    default = Qwen3Config(**QWEN3)
    assert not torch.allclose(hf[0], hf_cos_sin(default, positions)[0], atol=1e-2)


def test_yarn_with_partial_rotary_and_a_4x_shaped_config() -> None:
    shape = {**QWEN3, "head_dim": 16, "original_max_position_embeddings": 32}
    config = LlamaConfig(**shape, rope_parameters={**YARN, "rope_theta": 1e4,
                                                    "partial_rotary_factor": 0.75})
    v4 = SimpleNamespace(**shape, rope_theta=1e4, partial_rotary_factor=0.75,
                         rope_scaling={"type": "yarn", "factor": 4.0})
    positions = range(100)
    hf = hf_cos_sin(config, positions)
    assert hf[0].shape == (100, 6)
    assert_same(engine_cos_sin(config, positions), hf)
    # The config's own original_max_position_embeddings (32) wins over the settings' (64),
    # as transformers 5 moves it there; a 4.x-shaped config has it only there.
    assert config.rope_parameters["original_max_position_embeddings"] == 32
    assert rope_settings(v4)["original_max_position_embeddings"] == 32
    assert_same(engine_cos_sin(v4, positions), hf)


@pytest.mark.parametrize("partial", [1.0, 0.75])
@pytest.mark.parametrize("extra", [{}, {"factor": 2.0}, {"attention_factor": 1.1}],
                         ids=["implicit_factor", "factor", "attention_factor"])
def test_longrope_equals_transformers_with_either_set_of_factors(
        partial: float, extra: dict[str, Any]) -> None:
    n = int(16 * partial) // 2
    config = Phi3Config(**PHI3, partial_rotary_factor=partial,
                        rope_parameters={**longrope(n, **extra), "rope_theta": 1e4})
    original = 32
    # transformers: a pass within the original context rotates by the short factors; the
    # engine does when it serves at most that (max_model_len).
    within = range(original)
    short = hf_cos_sin(config, within)
    assert_same(engine_cos_sin(config, within, max_model_len=original), short)
    # A pass reaching past it: the long factors for every position, as the engine serving
    # longer sequences (max_model_len, default the config's max_position_embeddings).
    beyond = range(original + 8)
    long = hf_cos_sin(config, beyond)
    assert_same(engine_cos_sin(config, beyond), long)
    assert_same(engine_cos_sin(config, beyond, max_model_len=original + 1), long)
    assert not torch.allclose(short[0][1:], long[0][1:original], atol=1e-2)


def test_longrope_of_a_4x_su_config_reads_the_top_level_original_context() -> None:
    v4 = SimpleNamespace(**{k: v for k, v in PHI3.items() if k != "pad_token_id"},
                         rope_theta=1e4, rope_scaling={"type": "su", "short_factor": SHORT,
                                                       "long_factor": LONG})
    config = Phi3Config(**PHI3, rope_parameters={**longrope(8), "rope_theta": 1e4})
    for positions, max_model_len in ((range(32), 32), (range(50), None)):
        assert_same(engine_cos_sin(v4, positions, max_model_len),
                    hf_cos_sin(config, positions))


def test_dynamic_ntk_equals_transformers_within_max_position_embeddings() -> None:
    config = LlamaConfig(**{**QWEN3, "head_dim": 16},
                         rope_parameters={"rope_type": "dynamic", "factor": 4.0,
                                          "rope_theta": 1e4})
    positions = range(MAX_POSITION)  # the engine never serves beyond
    assert_same(engine_cos_sin(config, positions), hf_cos_sin(config, positions))


def test_unknown_types_and_missing_keys_name_what_is_wrong_and_allowed() -> None:
    factory = LayerFactory(dtype=torch.float32, block_size=4,
                           attention_backend=TorchAttentionBackend)
    supported = "default, linear, llama3, yarn, longrope, dynamic"
    with pytest.raises(ValueError, match=f"rope_type 'mrope' is not supported; supported: "
                                         f"{supported}"):
        factory.rotary_embedding(8, 8, 64, {"rope_type": "mrope", "rope_theta": 1e4})
    missing = {
        "yarn": ({"factor": 4.0}, "original_max_position_embeddings"),
        "longrope": ({"short_factor": [1.0] * 4, "original_max_position_embeddings": 32},
                     "long_factor"),
        "dynamic": ({}, "factor"),
    }
    for rope_type, (keys, key) in missing.items():
        with pytest.raises(KeyError, match=f"rope_type '{rope_type}' needs '{key}' in the "
                                           f"rope settings .*supported types: {supported}"):
            factory.rotary_embedding(8, 8, 64, {"rope_type": rope_type, "rope_theta": 1e4,
                                                **keys})
    with pytest.raises(ValueError, match=r"long_factor must have rotary_dim / 2 = 4 numbers, "
                                         r"got 3"):
        factory.rotary_embedding(8, 8, 64, {
            "rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 4,
            "long_factor": [1.0] * 3, "original_max_position_embeddings": 32})


# End to end --------------------------------------------------------------------------

#: Past the original context (64): prompt 1 (the logits) has 77 tokens.
YARN_PROMPTS = [[5, 9, 33, 7], list(range(40, 117)), [300], list(range(120, 190))]


@pytest.fixture(scope="module")
def tiny_qwen3_yarn(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "qwen3-yarn", "qwen3",
                                 rope_scaling=YARN)


def test_qwen3_with_yarn_gives_the_logits_and_tokens_of_transformers(
        tiny_qwen3_yarn: Path) -> None:
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(tiny_qwen3_yarn).rope_parameters["rope_type"] == "yarn"
    ModelChecks(tiny_qwen3_yarn, Qwen3ForCausalLM, prompts=YARN_PROMPTS
                ).logits_and_greedy_tokens()


#: All past Phi-3's original context (32).
LONG_PROMPTS = [list(range(40, 77)), list(range(100, 140)), list(range(200, 233)),
                list(range(300, 350))]


@pytest.fixture(scope="module")
def tiny_phi3_longrope(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "phi3-longrope", "phi3",
                                 original_max_position_embeddings=32,
                                 rope_scaling=longrope(8))


def test_phi3_with_long_factors_past_the_original_context(tiny_phi3_longrope: Path) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_phi3_longrope)
    assert config.rope_parameters["rope_type"] == "longrope"
    assert config.max_position_embeddings == MAX_POSITION
    # Every prompt is longer than 32: transformers' every pass uses the long factors, as the
    # engine does serving up to 256 tokens.
    ModelChecks(tiny_phi3_longrope, Phi3ForCausalLM, prompts=LONG_PROMPTS
                ).logits_and_greedy_tokens()


def test_phi3_with_long_factors_in_chunks(tiny_phi3_longrope: Path) -> None:
    # One cache for every position: chunks of 8 (within 32) rotate as the whole prompt.
    # (ModelChecks.prefix_cache's prompts of 27 tokens are not for this checkpoint:
    # transformers rotates them by the short factors, then switches while generating.)
    ModelChecks(tiny_phi3_longrope, Phi3ForCausalLM, prompts=LONG_PROMPTS).chunked_prefill()


def test_phi3_with_short_factors_within_the_original_context(
        tiny_phi3_longrope: Path) -> None:
    # Prompt and output within 32 tokens, and an engine serving at most 32: short factors.
    prompts = [[5, 9, 33, 7], list(range(40, 60)), [300], list(range(100, 117))]
    checks = ModelChecks(tiny_phi3_longrope, Phi3ForCausalLM, prompts=prompts, max_tokens=8)
    checks.options["max_model_len"] = 32
    model = checks.logits_and_greedy_tokens()
    short = engine_cos_sin(Phi3Config(**PHI3, rope_parameters={**longrope(8),
                                                               "rope_theta": 1e4}),
                           range(32), max_model_len=32)
    cache = model.layers[0].self_attn.rotary_emb.cos_sin_cache
    assert torch.equal(cache[:32], torch.cat(short, dim=-1))
