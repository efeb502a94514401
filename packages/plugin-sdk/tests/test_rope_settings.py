"""``engine.sdk.layers.rope_settings``: a config of either transformers era, one shape.

The configs here are built by hand with the attributes each era has (transformers 4.x:
``rope_theta``, ``rope_scaling``, ``partial_rotary_factor``; 5.x: ``rope_parameters``), so
both are tested whichever transformers is installed (engine-core's tests use real ones).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.sdk.layers import rope_settings

LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def test_a_transformers_4_config() -> None:
    config = SimpleNamespace(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", **LLAMA3})
    assert rope_settings(config) == {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3}
    older = SimpleNamespace(rope_theta=1e6, rope_scaling={"type": "linear", "factor": 2.0},
                            partial_rotary_factor=0.5)
    assert rope_settings(older) == {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0,
                                    "partial_rotary_factor": 0.5}
    unscaled = SimpleNamespace(rope_theta=10000, rope_scaling=None)
    assert rope_settings(unscaled) == {"rope_type": "default", "rope_theta": 10000.0}


def test_a_transformers_5_config() -> None:
    config = SimpleNamespace(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                              **LLAMA3})
    assert rope_settings(config) == {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3}
    partial = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                               "partial_rotary_factor": 0.25})
    assert rope_settings(partial)["partial_rotary_factor"] == 0.25


def test_both_eras_give_the_same_settings() -> None:
    old = SimpleNamespace(rope_theta=5e5, rope_scaling={"type": "llama3", **LLAMA3},
                          partial_rotary_factor=0.5)
    new = SimpleNamespace(rope_parameters={"rope_theta": 5e5, "rope_type": "llama3", **LLAMA3,
                                           "partial_rotary_factor": 0.5})
    assert rope_settings(old) == rope_settings(new)


def test_the_original_context_is_filled_in_as_transformers_5_does() -> None:
    factors = {"short_factor": [1.0], "long_factor": [2.0]}
    phi3 = SimpleNamespace(rope_theta=1e4, rope_scaling={"type": "su", **factors},
                           original_max_position_embeddings=4096,
                           max_position_embeddings=131072)
    assert rope_settings(phi3) == {"rope_type": "su", "rope_theta": 1e4, **factors,
                                   "original_max_position_embeddings": 4096}
    # The config's attribute wins over the settings' key; without either, the config's
    # max_position_embeddings; types that do not use it get none.
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    both = SimpleNamespace(rope_scaling=yarn, original_max_position_embeddings=8192)
    assert rope_settings(both)["original_max_position_embeddings"] == 8192
    assert rope_settings(SimpleNamespace(rope_scaling=yarn)
                         )["original_max_position_embeddings"] == 32768
    bare = SimpleNamespace(rope_scaling={"type": "yarn", "factor": 4.0},
                           max_position_embeddings=2048)
    assert rope_settings(bare)["original_max_position_embeddings"] == 2048
    linear = SimpleNamespace(rope_scaling={"type": "linear", "factor": 2.0},
                             max_position_embeddings=2048)
    assert "original_max_position_embeddings" not in rope_settings(linear)


def test_a_config_without_rope_settings_gets_the_defaults() -> None:
    assert rope_settings(SimpleNamespace()) == {"rope_type": "default", "rope_theta": 10000.0}


def test_settings_per_layer_type_need_the_layer_type() -> None:
    config = SimpleNamespace(rope_parameters={
        "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    assert rope_settings(config, "sliding_attention") == {"rope_type": "default",
                                                          "rope_theta": 1e4}
    assert rope_settings(config, "full_attention")["factor"] == 8.0
    with pytest.raises(ValueError, match="differ per layer type \\(full_attention, "
                       "sliding_attention\\); pass layer_type= one of them, got None"):
        rope_settings(config)


def test_the_result_is_a_new_dict() -> None:
    params = {"rope_type": "default", "rope_theta": 1e4}
    settings = rope_settings(SimpleNamespace(rope_parameters=params))
    settings["factor"] = 2.0
    assert params == {"rope_type": "default", "rope_theta": 1e4}
