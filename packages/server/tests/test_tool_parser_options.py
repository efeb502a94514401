"""``--plugin-option`` for tool parsers: checked when the server picks its parser.

The server, not the engine's config, chooses the tool parser (``--tool-call-parser``), so
the app checks the values given to every tool parser when it loads its own: a bad value
stops start-up naming the parser; a valid one for a parser the server does not use is
logged as having no effect.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from pydantic import Field

from engine.core.client.async_llm import AsyncLLM, in_process_client
from engine.core.config import EngineConfig
from engine.sdk import PluginError, PluginOptions
from engine.sdk.groups import TOOL_PARSERS
from engine.sdk.tool_parser import ExtractedToolCalls, ToolParser
from engine.server.app import build_app
from engine.server.state import ServerArgs
from engine.testing.test_plugins import entry_installer

DIST = "engine-test-options"
COUNTING = f"plugin 'test_counting' (group engine.tool_parsers, distribution {DIST} 0.2)"


class CountingParser(ToolParser):
    """A tool parser with options (the built-in ones have none)."""

    class Options(PluginOptions):
        max_calls: int = Field(1, ge=1)

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        return ExtractedToolCalls(content=text)


@pytest.fixture
def counting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ENGINE_PLUGINS", raising=False)
    entry_installer(monkeypatch, DIST, "0.2")(TOOL_PARSERS, "test_counting", CountingParser)


def _app(checkpoint: Path, parser: str | None, options: dict[str, dict[str, Any]]) -> Any:
    config = EngineConfig(model=str(checkpoint), dtype="float32", num_kv_blocks=32,
                          plugin_options=options)
    engine = AsyncLLM(config, client=in_process_client, log_stats=False)
    return build_app(engine, ServerArgs(enable_auto_tool_choice=parser is not None,
                                        tool_call_parser=parser))


def test_bad_options_of_a_parser_the_server_does_not_use_stop_start_up(
        tiny_llama_checkpoint: Path, counting: None) -> None:
    with pytest.raises(PluginError) as info:
        _app(tiny_llama_checkpoint, "hermes", {"test_counting": {"max_calls": 0}})
    assert str(info.value) == (
        f"{COUNTING}: invalid --plugin-option test_counting: max_calls: Input should be "
        "greater than or equal to 1 (got 0). Accepted options: max_calls (int >= 1, default "
        "1) (checked although they would have no effect: this server uses tool parser "
        "'hermes' (--tool-call-parser))")
    with pytest.raises(PluginError, match="plugin 'hermes' .*invalid --plugin-option hermes: "
                       "strict: Extra inputs are not permitted. It accepts no options .*no "
                       "tool parser is selected \\(--tool-call-parser\\)"):
        _app(tiny_llama_checkpoint, None, {"hermes": {"strict": True}})


def test_valid_options_of_an_unused_parser_are_logged(
        tiny_llama_checkpoint: Path, counting: None, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, "engine.plugins"):
        _app(tiny_llama_checkpoint, "hermes", {"test_counting": {"max_calls": 2}})
    assert (f"{COUNTING}: --plugin-option test_counting is valid but has no effect: this "
            "server uses tool parser 'hermes' (--tool-call-parser)") in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, "engine.plugins"):
        app = _app(tiny_llama_checkpoint, "test_counting", {"test_counting": {"max_calls": 2}})
    assert "no effect" not in caplog.text  # the server's parser: it gets them
    assert app.state.server.tool_parser.cls is CountingParser
