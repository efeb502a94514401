"""Plugin options: validated per plugin, unknown names refused, failures name the plugin."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from engine.core import LLM, __version__
from engine.sdk import PluginError, ValidationError

IO = "engine-test-plugin-io"
IO_IDENTITY = ("plugin 'test_io_prompts' (group engine.io_processors, distribution "
               "engine-test-plugin-io 0.1.0)")


def _llm(checkpoint: Path, **kwargs: Any) -> LLM:
    return LLM(str(checkpoint), dtype="float32", num_kv_blocks=32, in_process=True, **kwargs)


def test_unknown_plugin_option_name_is_refused(tiny_llama: Path) -> None:
    with pytest.raises(ValidationError, match="'fcsf'.*not an installed plugin; installed and "
                       "allowed: .*fcfs"):
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
    with pytest.raises(PluginError) as info:
        LLM(str(tiny_llama), dtype="float32", num_kv_blocks=128, in_process=True,
            plugin_options={"LlamaForCausalLM": {"depth": 3}})
    assert str(info.value) == (
        "plugin 'LlamaForCausalLM' (group engine.models, distribution engine-core "
        f"{__version__}): invalid --plugin-option LlamaForCausalLM: depth: Extra "
        "inputs are not permitted. It accepts no options")
    assert info.value.__suppress_context__  # no pydantic dump under the message
    with pytest.raises(PluginError, match="'cpu'.*attention_backends.*invalid --plugin-option "
                       "engine.attention_backends:cpu: window: Extra inputs"):
        LLM(str(tiny_llama), dtype="float32", num_kv_blocks=128, in_process=True,
            plugin_options={"attention_backends:cpu": {"window": 3}})


def test_same_named_plugins_of_two_groups_need_the_group(tiny_llama: Path) -> None:
    # `torch` is both an attention backend and a linear kernel.
    with pytest.raises(ValidationError, match="'torch' is ambiguous.*attention_backends:torch"
                       ".*linear_kernels:torch"):
        LLM(str(tiny_llama), dtype="float32", num_kv_blocks=128, in_process=True,
            plugin_options={"torch": {"window": 3}})
    with pytest.raises(ValidationError, match="'engine.schedulers:torch'.*not an installed"):
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


def test_bad_options_of_an_unselected_plugin_stop_start_up(tiny_llama: Path,
                                                           plugins_on_path: Path) -> None:
    # test_io_prompts is installed and allowed, but no --io-processor selects it.
    with pytest.raises(PluginError) as info:
        _llm(tiny_llama, plugins=IO, plugin_options={"test_io_prompts": {"max_prompts": 0}})
    assert str(info.value) == (
        f"{IO_IDENTITY}: invalid --plugin-option test_io_prompts: max_prompts: Input should "
        "be greater than or equal to 1 (got 0). Accepted options: max_prompts (int >= 1, "
        "default 4) (checked although they would have no effect: no IO processor is "
        "selected (--io-processor))")
    with pytest.raises(PluginError, match="invalid --plugin-option "
                       "engine.io_processors:test_io_prompts: bogus"):
        _llm(tiny_llama, plugins=IO, io_processor="test_io_words",
             plugin_options={"io_processors:test_io_prompts": {"bogus": 1}})
    with pytest.raises(PluginError, match="'test_good_lifo' .*engine-test-plugin-good 0.1.0.*"
                       "aging: Extra inputs are not permitted. It accepts no options"):
        _llm(tiny_llama, plugins="engine-test-plugin-good",
             plugin_options={"test_good_lifo": {"aging": 2}})


def test_valid_options_of_an_unselected_plugin_are_logged_as_having_no_effect(
        tiny_llama: Path, plugins_on_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, "engine.plugins"), _llm(
            tiny_llama, plugins=IO, io_processor="test_io_words",
            plugin_options={"test_io_prompts": {"max_prompts": 2}}) as llm:
        assert llm.llm_engine.io_processor is not None
    assert (f"{IO_IDENTITY}: --plugin-option test_io_prompts is valid but has no effect: "
            "this engine uses IO processor 'test_io_words' (--io-processor)") in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, "engine.plugins"), _llm(
            tiny_llama, plugins=IO, io_processor="test_io_prompts",
            plugin_options={"test_io_prompts": {"max_prompts": 2}}):
        pass
    assert "no effect" not in caplog.text  # selected: the processor got them


def test_options_for_a_group_that_takes_none_are_refused(tiny_llama: Path) -> None:
    # Linear kernels receive no options in SDK 1.x: even the selected one cannot take any.
    with pytest.raises(PluginError, match="'torch' \\(group engine.linear_kernels, "
                       "distribution engine-core .*window: Extra inputs are not permitted. It "
                       "accepts no options .*engine.linear_kernels plugins receive no options"):
        _llm(tiny_llama, plugin_options={"linear_kernels:torch": {"window": 3}})


def test_options_for_an_unselected_built_in_are_validated(tiny_llama: Path) -> None:
    with pytest.raises(PluginError, match="'priority' .*scheduling_policies.*aging: Extra "
                       "inputs.*this engine uses scheduling policy 'fcfs'"):
        _llm(tiny_llama, plugin_options={"priority": {"aging": 2}})


def test_options_for_a_plugin_the_allowlist_skips_say_why(tiny_llama: Path,
                                                         plugins_on_path: Path) -> None:
    with pytest.raises(ValidationError) as info:
        _llm(tiny_llama, plugins="none", plugin_options={"test_io_prompts": {"max_prompts": 2}})
    assert str(info.value) == (
        f"{IO_IDENTITY}: --plugin-option 'test_io_prompts' gives it options, but it is "
        "installed and not allowed (--plugins=none). Allow it with --plugins, or drop the "
        "option.")
