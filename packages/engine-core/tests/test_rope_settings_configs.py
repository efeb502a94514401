"""Rope settings of real transformers configs, and the built-in Llama reading the same.

``engine.sdk.layers.rope_settings`` is the one reader of rope settings: plugin models call
it, and so does the built-in Llama family. A transformers 5 config (``rope_parameters``,
the installed transformers) and the same settings spelt as transformers 4 did
(``rope_theta``, ``rope_scaling``, ``partial_rotary_factor``) build the same rotary op.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import transformers
from transformers import Gemma3TextConfig, LlamaConfig, PhiConfig

from engine.core.attention import TorchAttentionBackend
from engine.core.model_executor.layers import LayerFactory
from engine.core.model_executor.models.llama import LlamaAttention
from engine.sdk.layers import rope_settings

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
SHAPE = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 16384}


def transformers_4_shape(config: Any) -> SimpleNamespace:
    """``config``'s attributes, with its rope settings where transformers 4 kept them."""
    params = dict(config.rope_parameters)
    fields = {k: v for k, v in vars(config).items() if not k.startswith("rope")}
    partial = params.pop("partial_rotary_factor", None)
    return SimpleNamespace(**fields, rope_theta=params.pop("rope_theta"),
                           rope_scaling=params, partial_rotary_factor=partial)


def test_transformers_5_is_installed() -> None:
    assert int(transformers.__version__.split(".")[0]) >= 5  # else: what rope_parameters is


def test_a_llama_3_config() -> None:
    config = LlamaConfig(**SHAPE, rope_parameters={**LLAMA3, "rope_theta": 5e5})
    assert not hasattr(config, "rope_theta")  # what a 4.x-era plugin read
    expected = {**LLAMA3, "rope_theta": 5e5}
    assert rope_settings(config) == expected
    assert rope_settings(transformers_4_shape(config)) == expected


def test_partial_rotary_and_per_layer_type_settings() -> None:
    assert rope_settings(PhiConfig(partial_rotary_factor=0.4))["partial_rotary_factor"] == 0.4
    gemma = Gemma3TextConfig()
    assert rope_settings(gemma, "sliding_attention")["rope_theta"] == 10000.0
    assert rope_settings(gemma, "full_attention")["rope_theta"] == 1e6
    with pytest.raises(ValueError, match="pass layer_type="):
        rope_settings(gemma)


@pytest.mark.parametrize("partial", [None, 0.5])
def test_the_built_in_llama_reads_either_era_alike(partial: float | None) -> None:
    extra = {} if partial is None else {"partial_rotary_factor": partial}
    config = LlamaConfig(**SHAPE, rope_parameters={**LLAMA3, "rope_theta": 5e5, **extra})
    factory = LayerFactory(dtype=torch.float32, block_size=4,
                           attention_backend=TorchAttentionBackend)
    new = LlamaAttention(config, factory, "layers.0.self_attn", qkv_bias=False).rotary_emb
    old = LlamaAttention(transformers_4_shape(config), factory, "layers.0.self_attn",
                         qkv_bias=False).rotary_emb
    assert new.rotary_dim == old.rotary_dim == int(16 * (partial or 1.0))
    assert torch.equal(new.cos_sin_cache, old.cos_sin_cache)
