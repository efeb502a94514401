"""Every group that takes options: a bad value is refused at start-up, naming all of it.

Each options error names the plugin, group and distribution, where the values came from,
each key and what was wrong with it, and what the plugin's ``Options`` accepts; values for
a plugin the engine does not use are still checked, and logged as having no effect.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from pydantic import Field

from engine.core import LLM
from engine.core.engine.engine_core import EngineCore
from engine.sdk import PluginError, PluginOptions, StatLogger
from engine.sdk.groups import GROUPS, STAT_LOGGERS, TOOL_PARSERS
from engine.sdk.tool_parser import ExtractedToolCalls, ToolParser
from engine.testing.test_plugins import entry_installer

DIST = "engine-test-options"
STRUCTURED = "engine-test-plugin-structured"
KVCONN = "engine-test-plugin-kvconn"
DIGITS = ("plugin 'test_digits' (group engine.structured_output_backends, distribution "
          "engine-test-plugin-structured 0.1.0)")
RECORDER = ("plugin 'test_recorder' (group engine.kv_connectors, distribution "
            "engine-test-plugin-kvconn 0.1.0)")
RECORDER_ACCEPTS = ("Accepted options: events (str | None, default None), load_async (bool, "
                    "default False), delay_free (bool, default False), fail_in (str | None, "
                    "default None), fail_times (int >= 0, default 0)")


def _llm(checkpoint: Path, **kwargs: Any) -> LLM:
    return LLM(str(checkpoint), dtype="float32", num_kv_blocks=32, in_process=True, **kwargs)


class CountingParser(ToolParser):
    """A tool parser with options (none of the installed ones has any)."""

    class Options(PluginOptions):
        max_calls: int = Field(1, ge=1)

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        return ExtractedToolCalls(content=text)


class PortStatLogger(StatLogger):
    """A stat logger with a bounded option."""

    class Options(PluginOptions):
        port: int = Field(8125, ge=1, le=65535)

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        pass


class PathStatLogger(StatLogger):
    """A stat logger with a required option."""

    class Options(PluginOptions):
        path: str

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        pass


@pytest.fixture
def no_engine_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building EngineCore (and so loading the model) fails the test."""
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("EngineCore was built: the options were checked too late")

    monkeypatch.setattr(EngineCore, "__init__", refuse)


def test_every_group_has_an_options_rule() -> None:
    from engine.core import plugin_options as rules

    covered = [*rules.NO_OPTIONS_GROUPS, *rules._SELECTED_BY_FLAG, *rules.ALL_USED_GROUPS,
               *rules.APPLICATION_CHOICES, *rules.DECIDED_AT_START_UP]
    assert sorted(covered) == sorted(GROUPS)  # each group exactly once


def test_options_of_an_unselected_tool_parser_are_checked(tiny_llama: Path,
                                                           plugins_on_path: Path) -> None:
    # LLM parses no tool calls: a tool parser's options never have an effect there.
    with pytest.raises(PluginError) as info:
        _llm(tiny_llama, plugins=STRUCTURED, plugin_options={"test_echo": {"bogus": 1}})
    assert str(info.value) == (
        "plugin 'test_echo' (group engine.tool_parsers, distribution "
        "engine-test-plugin-structured 0.1.0): invalid --plugin-option test_echo: bogus: Extra "
        "inputs are not permitted. It accepts no options (checked although they would have "
        "no effect: LLM parses no tool calls (tool parsers serve `engine serve "
        "--tool-call-parser`))")


def test_valid_options_of_a_tool_parser_are_logged_under_llm(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    entry_installer(monkeypatch, DIST, "0.2")(TOOL_PARSERS, "test_counting", CountingParser)
    with pytest.raises(PluginError, match="invalid --plugin-option test_counting: max_calls: "
                       "Input should be greater than or equal to 1 \\(got 0\\). Accepted "
                       "options: max_calls \\(int >= 1, default 1\\)"):
        _llm(tiny_llama, plugin_options={"test_counting": {"max_calls": 0}})
    with caplog.at_level(logging.INFO, "engine.plugins"), _llm(
            tiny_llama, plugin_options={"test_counting": {"max_calls": 2}}):
        pass
    assert ("plugin 'test_counting' (group engine.tool_parsers, distribution "
            f"{DIST} 0.2): --plugin-option test_counting is valid but has no effect: LLM "
            "parses no tool calls") in caplog.text


def test_options_of_an_unselected_structured_output_backend_are_checked(
        tiny_llama: Path, plugins_on_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # The default backend is xgrammar: test_digits' options would have no effect.
    with pytest.raises(PluginError) as info:
        _llm(tiny_llama, plugins=STRUCTURED, plugin_options={"test_digits": {"min_digits": -1}})
    assert str(info.value) == (
        f"{DIGITS}: invalid --plugin-option test_digits: min_digits: Input should be greater "
        "than or equal to 0 (got -1). Accepted options: min_digits (int >= 0, default 3) "
        "(checked although they would have no effect: this engine uses structured-output "
        "backend 'xgrammar' (--structured-outputs-backend))")
    with caplog.at_level(logging.INFO, "engine.plugins"), _llm(
            tiny_llama, plugins=STRUCTURED, plugin_options={"test_digits": {"min_digits": 1}}):
        pass
    assert (f"{DIGITS}: --plugin-option test_digits is valid but has no effect: this engine "
            "uses structured-output backend 'xgrammar'") in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, "engine.plugins"), _llm(
            tiny_llama, plugins=STRUCTURED, structured_outputs_backend="test_digits",
            plugin_options={"test_digits": {"min_digits": 1}}):
        pass
    assert "no effect" not in caplog.text  # selected: the backend got them


def test_bad_kv_connector_options_name_the_key_and_what_it_accepts(
        tiny_llama: Path, plugins_on_path: Path) -> None:
    with pytest.raises(PluginError) as info:
        _llm(tiny_llama, plugins=KVCONN, kv_connector="test_recorder",
             kv_connector_options={"fail_times": -1})
    assert str(info.value) == (
        f"{RECORDER}: invalid --kv-connector-option: fail_times: Input should be greater than "
        f"or equal to 0 (got -1). {RECORDER_ACCEPTS}")
    assert "errors.pydantic.dev" not in str(info.value)
    with pytest.raises(PluginError) as info:  # both ways of giving them, before EngineCore
        _llm(tiny_llama, plugins=KVCONN, kv_connector="test_recorder",
             kv_connector_options={"load_async": True},
             plugin_options={"test_recorder": {"fail_in": ["x"]}})
    assert str(info.value) == (
        f"{RECORDER}: invalid --plugin-option test_recorder and --kv-connector-option: "
        f"fail_in: Input should be a valid string (got ['x']). {RECORDER_ACCEPTS}")


def test_bad_stat_logger_options_stop_start_up_before_the_model_loads(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, no_engine_core: None) -> None:
    entry_installer(monkeypatch, DIST, "0.2")(STAT_LOGGERS, "test_port", PortStatLogger)
    with pytest.raises(PluginError) as info:
        _llm(tiny_llama, plugin_options={"test_port": {"port": 0}})
    assert str(info.value) == (
        f"plugin 'test_port' (group engine.stat_loggers, distribution {DIST} 0.2): invalid "
        "--plugin-option test_port: port: Input should be greater than or equal to 1 (got 0). "
        "Accepted options: port (int >= 1, <= 65535, default 8125)")


def test_a_stat_loggers_missing_option_stops_start_up_before_the_model_loads(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, no_engine_core: None) -> None:
    entry_installer(monkeypatch, DIST, "0.2")(STAT_LOGGERS, "test_path", PathStatLogger)
    with pytest.raises(PluginError) as info:
        _llm(tiny_llama)
    assert str(info.value) == (
        f"plugin 'test_path' (group engine.stat_loggers, distribution {DIST} 0.2): invalid "
        "options (none given): path: Field required. Accepted options: path (str, required)")
