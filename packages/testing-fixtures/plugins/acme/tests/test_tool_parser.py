"""acme_function_tags: whole outputs, streams in any split, and what is not a call."""

from __future__ import annotations

import json

import pytest
from acme_engine_plugins.tool_parser import FunctionTagParser

from engine.sdk.tool_parser import ToolParserContext

TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
         for name in ("get_weather", "get_time")]
TEXT = ('Let me check. <function=get_weather>{"city": "Paris"}</function>'
        '<function=get_time> {"tz": "Europe/Paris"} </function> Done.')


def make() -> FunctionTagParser:
    return FunctionTagParser(ToolParserContext(plugin_name="acme_function_tags"), TOOLS)


def test_whole_output() -> None:
    result = make().extract_tool_calls(TEXT)
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris"})]
    assert result.content == "Let me check.  Done."


@pytest.mark.parametrize("text", [
    '<function=delete_all>{"really": true}</function>',  # not offered
    '<function=get_weather>{"city": "Par',  # cut off
    '<function=get_weather>["Paris"]</function>',  # not an object
    "no calls at all",
])
def test_what_is_not_a_call_is_content(text: str) -> None:
    result = make().extract_tool_calls(text)
    assert not result.tools_called and result.content == text


def test_calls_once_found_stay_found() -> None:
    parser = make()
    for end in range(len(TEXT) + 1):
        calls = parser.extract_tool_calls(TEXT[:end]).tool_calls
        assert [c.name for c in calls] == ["get_weather", "get_time"][:len(calls)]


@pytest.mark.parametrize("piece", [1, 3, 7, 200])
def test_streaming_sends_the_same_in_any_split(piece: int) -> None:
    parser = make()
    deltas = [parser.extract_tool_calls_streaming(TEXT[i:i + piece])
              for i in range(0, len(TEXT), piece)]
    deltas.append(parser.finish_streaming())
    sent = [d for d in deltas if d is not None]
    content = "".join(d.content or "" for d in sent)
    assert "<function" not in content and content.strip() == "Let me check.  Done."
    calls = [c for d in sent for c in d.tool_calls]
    assert [(c.index, c.name) for c in calls] == [(0, "get_weather"), (1, "get_time")]
    assert all(c.id is not None and c.id.startswith("call_") for c in calls)
