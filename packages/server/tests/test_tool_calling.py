"""Tool calling over HTTP with the official ``openai`` client (issue 14).

Named and ``required`` choices are enforced with structured outputs, so even the tiny random
checkpoint returns parsable calls with the schema's arguments. ``auto`` is served by the
``--tool-call-parser`` (``hermes`` here); a regex makes the random model write a Hermes
call, which proves the parser is reached, while a request without tools stays plain text.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from engine.testing.server import RemoteServer, running_server
from engine.testing.test_plugins import env_with_plugins, install_test_plugins

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8},
                   "unit": {"type": "string", "enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
        "required": ["zone"], "additionalProperties": False}}},
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server(tiny_llama_checkpoint: Path) -> Iterator[RemoteServer]:
    with running_server(tiny_llama_checkpoint, ["--enable-auto-tool-choice",
                                                "--tool-call-parser", "hermes"],
                        served_model_name="tiny") as remote:
        yield remote


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    client: openai.OpenAI = server.client()
    return client


def _chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs = {"messages": MESSAGES, "max_tokens": 100, "tools": TOOLS, **kwargs}
    return client.chat.completions.create(model="tiny", temperature=0, **kwargs)


def _streamed_calls(client: openai.OpenAI, **kwargs: Any
                    ) -> tuple[list[tuple[str, str]], str, str | None]:
    """The streamed calls reassembled as (name, arguments), the content, the finish."""
    calls: dict[int, list[str]] = {}
    content, finish = "", None
    for chunk in _chat(client, stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, ["", "", ""])
                entry[0] += delta.id or ""
                entry[1] += delta.function.name or ""
                entry[2] += delta.function.arguments or ""
    for call_id, _, _ in calls.values():
        assert call_id, "a streamed call's first delta carries its id"
    return [(name, args) for _, name, args in (calls[i] for i in sorted(calls))], content, finish


def test_named_choice_returns_a_call_with_the_schema_arguments(client: openai.OpenAI) -> None:
    choice = _chat(client, tool_choice=NAMED).choices[0]
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert choice.message.content is None
    assert choice.finish_reason == "stop"


def test_named_choice_streams_to_the_same_call(client: openai.OpenAI) -> None:
    whole = _chat(client, tool_choice=NAMED).choices[0].message.tool_calls[0]
    calls, content, finish = _streamed_calls(client, tool_choice=NAMED)
    assert calls == [(whole.function.name, whole.function.arguments)]
    assert (content, finish) == ("", "stop")


def test_required_choice_calls_one_of_the_tools(client: openai.OpenAI) -> None:
    choice = _chat(client, tool_choice="required", max_tokens=150).choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    assert choice.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    calls, _, finish = _streamed_calls(client, tool_choice="required", max_tokens=150)
    assert calls == [(c.function.name, c.function.arguments)
                     for c in choice.message.tool_calls]
    assert finish == "tool_calls"


def test_required_without_parallel_calls_makes_one(client: openai.OpenAI) -> None:
    choice = _chat(client, tool_choice="required", parallel_tool_calls=False,
                   max_tokens=150).choices[0]
    assert len(choice.message.tool_calls) == 1


HERMES_REGEX = (r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,6}", '
                r'"unit": "C"\}\}</tool_call>')


def test_auto_choice_goes_through_the_tool_call_parser(client: openai.OpenAI) -> None:
    extra = {"guided_regex": HERMES_REGEX}
    choice = _chat(client, tool_choice="auto", extra_body=extra).choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls, content, finish = _streamed_calls(client, extra_body=extra)  # auto: the default
    assert calls == [(call.function.name, call.function.arguments)]
    assert (content, finish) == ("", "tool_calls")


def test_plain_text_is_left_alone(client: openai.OpenAI) -> None:
    without = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0,
                                             max_tokens=12).choices[0]
    assert without.message.tool_calls in (None, [])
    none = _chat(client, tool_choice="none", max_tokens=12).choices[0]
    assert none.message.tool_calls in (None, []) and none.finish_reason == "length"
    auto = _chat(client, tool_choice="auto", max_tokens=12).choices[0]  # no call in its text
    assert auto.message.tool_calls in (None, []) and auto.finish_reason == "length"


def test_a_conversation_with_tool_results_is_rendered(client: openai.OpenAI) -> None:
    messages = [*MESSAGES,
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function", "function": {
                        "name": "get_weather", "arguments": "{\"city\": \"paris\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    choice = _chat(client, messages=messages, tool_choice="none", max_tokens=5).choices[0]
    assert choice.finish_reason == "length"


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
    ({"tool_choice": "sometimes"}, "tool_choice", "must be"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools.0.function.name", "letters, digits"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type", "only function tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id",
     "must name the call"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
     "messages.0.tool_calls", "only assistant"),
])
def test_bad_tool_fields_are_a_400_naming_them(client: openai.OpenAI, extra: dict[str, Any],
                                               param: str, words: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, **{"tool_choice": "auto", **extra})
    body = info.value.body
    assert isinstance(body, dict)
    assert body["param"] == param, body
    assert words in body["message"], body


@pytest.fixture(scope="module")
def echo_client(tiny_llama_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[openai.OpenAI]:
    """A server whose --tool-call-parser is the test plugin's ``test_echo``."""
    target = install_test_plugins(tmp_path_factory.mktemp("tool-parser"), ("structured",))
    with running_server(tiny_llama_checkpoint, [
            "--plugins", "engine-test-plugin-structured", "--enable-auto-tool-choice",
            "--tool-call-parser", "test_echo"], served_model_name="tiny",
            env=env_with_plugins(target)) as remote:
        yield remote.client()


def test_a_plugin_tool_parser_is_reached_and_selective(echo_client: openai.OpenAI) -> None:
    extra = {"guided_regex": "CALL:[a-z]{3};"}
    choice = _chat(echo_client, extra_body=extra).choices[0]
    (call,) = choice.message.tool_calls
    assert call.id == "echo_3" and call.function.name == "get_weather"
    text = json.loads(call.function.arguments)["text"]
    assert len(text) == 3 and text.isalpha()
    assert choice.finish_reason == "tool_calls"
    calls, content, _ = _streamed_calls(echo_client, extra_body=extra)
    assert calls == [("get_weather", call.function.arguments)] and content == ""
    # Not reached: no tools, or tool_choice "none" (the same constrained text stays content).
    plain = echo_client.chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=0, max_tokens=10,
        extra_body=extra).choices[0]
    assert plain.message.content.startswith("CALL:") and not plain.message.tool_calls
    none = _chat(echo_client, tool_choice="none", extra_body=extra).choices[0]
    assert none.message.content == plain.message.content and not none.message.tool_calls


def test_a_failing_tool_parser_fails_only_its_request(echo_client: openai.OpenAI) -> None:
    extra = {"guided_regex": "CALL:fail;"}
    with pytest.raises(openai.InternalServerError) as info:
        _chat(echo_client, extra_body=extra)
    body = info.value.body
    assert isinstance(body, dict) and body["code"] == "plugin_error"
    assert "plugin 'test_echo' (group engine.tool_parsers" in body["message"]
    assert "RuntimeError: asked to fail" in body["message"]
    stream = _chat(echo_client, extra_body=extra, stream=True)
    with pytest.raises(openai.APIError, match="test_echo"):
        for _ in stream:
            pass
    ok = _chat(echo_client, extra_body={"guided_regex": "CALL:ok;"}).choices[0]
    assert ok.message.tool_calls[0].id == "echo_2"
