"""Every plugin of the package that takes options: a bad option stops start-up with the
message docs/plugins/managing-plugins.md promises (the plugin, its group and distribution,
the key, what it accepts), whether the plugin is selected or not; a typo is never ignored."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from acme_engine_plugins.qwen3 import Qwen3ForCausalLM

from engine.sdk import PluginError

CASES = [
    # (plugin, group, engine kwargs, bad key)
    pytest.param("acme_shortest_job", "engine.scheduling_policies",
                 {"plugin_options": {"acme_shortest_job": {"unbounded_tokens": 0}}},
                 "unbounded_tokens", id="policy-unselected"),
    pytest.param("acme_shortest_job", "engine.scheduling_policies",
                 {"scheduling_policy": "acme_shortest_job",
                  "plugin_options": {"acme_shortest_job": {"unbounded_token": 5}}},
                 "unbounded_token", id="policy-selected"),
    pytest.param("acme_classify", "engine.io_processors",
                 {"plugin_options": {"acme_classify": {"max_texts": 0}}}, "max_texts",
                 id="io-unselected"),
    pytest.param("acme_classify", "engine.io_processors",
                 {"io_processor": "acme_classify",
                  "plugin_options": {"acme_classify": {"max_texts": 0}}}, "max_texts",
                 id="io-selected"),
    pytest.param("acme_lru", "engine.kv_connectors",
                 {"plugin_options": {"acme_lru": {"max_blocks": 0}}}, "max_blocks",
                 id="kv-unselected"),
    pytest.param("acme_lru", "engine.kv_connectors",
                 {"kv_connector": "acme_lru", "kv_connector_options": {"max_blocks": 0}},
                 "max_blocks", id="kv-selected"),
    pytest.param("acme_regex", "engine.structured_output_backends",
                 {"plugin_options": {"acme_regex": {"max_pattern_lenght": 9}}},
                 "max_pattern_lenght", id="structured-unselected"),
    pytest.param("acme_regex", "engine.structured_output_backends",
                 {"structured_outputs_backend": "acme_regex",
                  "plugin_options": {"acme_regex": {"max_pattern_length": 0}}},
                 "max_pattern_length", id="structured-selected"),
    pytest.param("acme_jsonl", "engine.stat_loggers",
                 {"plugin_options": {"acme_jsonl": {"pth": "/tmp/x.jsonl"}}}, "pth",
                 id="stat-logger"),
    pytest.param("acme_function_tags", "engine.tool_parsers",
                 {"plugin_options": {"acme_function_tags": {"strict": True}}}, "strict",
                 id="tool-parser-unselected"),
    pytest.param("acme_no_repeat_ngram", "engine.logits_processors",
                 {"plugin_options": {"acme_no_repeat_ngram": {"max_size": 4}}}, "max_size",
                 id="logits-processor"),
    pytest.param("acme_sdpa", "engine.attention_backends",
                 {"plugin_options": {"acme_sdpa": {"window": 4}}}, "window",
                 id="attention-unselected"),
    pytest.param("rms_norm", "engine.custom_ops",
                 {"plugin_options": {"custom_ops:rms_norm": {"eps": 1e-5}}}, "eps",
                 id="custom-op"),
]


@pytest.mark.parametrize(("plugin", "group", "kwargs", "key"), CASES)
def test_a_bad_option_stops_start_up_saying_what_is_accepted(
    tiny_qwen3: Path, make_llm: Callable[..., Any], plugin: str, group: str,
    kwargs: dict[str, Any], key: str,
) -> None:
    with pytest.raises(PluginError) as info:
        make_llm(tiny_qwen3, **kwargs).shutdown()
    message = str(info.value)
    assert f"plugin '{plugin}' (group {group}, distribution acme-engine-plugins" in message
    assert key in message
    assert "Accepted options:" in message or "It accepts no options" in message, message
    assert "errors.pydantic.dev" not in message, message


def test_stat_logger_options_are_checked_before_the_model_loads(
    tiny_qwen3: Path, make_llm: Callable[..., Any], spy: Callable[..., Any],
) -> None:
    calls = spy(Qwen3ForCausalLM, "__init__")
    with pytest.raises(PluginError, match="acme_jsonl"):
        make_llm(tiny_qwen3, plugin_options={"acme_jsonl": {"path": 3}}).shutdown()
    assert calls["__init__"] == 0
