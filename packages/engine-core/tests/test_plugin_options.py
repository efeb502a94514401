"""Plugin options: validated per plugin, unknown names refused, failures name the plugin."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.core import LLM
from engine.sdk import PluginError, ValidationError


def test_unknown_plugin_option_name_is_refused(tiny_llama: Path) -> None:
    with pytest.raises(ValidationError, match="'fcsf'.*not an allowed plugin.*fcfs"):
        LLM(str(tiny_llama), dtype="float32", num_kv_blocks=128, in_process=True,
            plugin_options={"fcsf": {"x": 1}})


def test_option_the_plugin_does_not_declare_names_the_plugin(tiny_llama: Path) -> None:
    with pytest.raises(PluginError) as info:
        LLM(str(tiny_llama), dtype="float32", num_kv_blocks=128, in_process=True,
            plugin_options={"fcfs": {"aging": 2}})
    message = str(info.value)
    assert "plugin 'fcfs' (group engine.scheduling_policies, distribution engine-core" in message
    assert "aging" in message


def test_options_reach_the_model_and_the_attention_backend(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=128, in_process=True)
    model = llm.llm_engine.core.worker.built.model
    assert type(model).Options.model_fields == {}  # built-ins declare no options
    with pytest.raises(PluginError, match="LlamaForCausalLM.*invalid options"):
        LLM(str(tiny_llama), dtype="float32", num_kv_blocks=128, in_process=True,
            plugin_options={"LlamaForCausalLM": {"depth": 3}})
    with pytest.raises(PluginError, match="'torch'.*attention_backends.*invalid options"):
        LLM(str(tiny_llama), dtype="float32", num_kv_blocks=128, in_process=True,
            plugin_options={"attention_backends:torch": {"window": 3}})


def test_same_named_plugins_of_two_groups_need_the_group(tiny_llama: Path) -> None:
    # `torch` is both an attention backend and a linear kernel.
    with pytest.raises(ValidationError, match="'torch' is ambiguous.*attention_backends:torch"
                       ".*linear_kernels:torch"):
        LLM(str(tiny_llama), dtype="float32", num_kv_blocks=128, in_process=True,
            plugin_options={"torch": {"window": 3}})
    with pytest.raises(ValidationError, match="'engine.schedulers:torch'.*not an allowed"):
        LLM(str(tiny_llama), dtype="float32", num_kv_blocks=128, in_process=True,
            plugin_options={"schedulers:torch": {"x": 1}})


def test_qualified_options_override_plain_ones() -> None:
    from engine.core.config import EngineConfig

    config = EngineConfig(plugin_options={
        "fcfs": {"a": 1, "b": 1}, "scheduling_policies:fcfs": {"b": 2},
        "engine.schedulers:default": {"c": 3}, "my_module:MyClass": {"d": 4}})
    assert config.options_for("engine.scheduling_policies", "fcfs") == {"a": 1, "b": 2}
    assert config.options_for("engine.schedulers", "default") == {"c": 3}
    assert config.options_for("engine.schedulers", "my_module:MyClass") == {"d": 4}
