"""Structured outputs over HTTP with the official ``openai`` client (issue 14).

``response_format`` (chat), ``structured_outputs`` and ``guided_*`` (chat and completions),
streaming and not, on the tiny random checkpoint. Its byte-level vocabulary and random
weights make it a demanding client of the grammar: it never writes valid JSON by chance.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from engine.testing.server import RemoteServer, running_server

#: Bounded fields (the random model would write digits forever in an unbounded integer).
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"type": "string", "enum": ["cat", "dog"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]},
                 "maxItems": 2},
    },
    "required": ["name", "kind", "ok", "tags"],
    "additionalProperties": False,
}
COMPACT_SCHEMA = {"json": SCHEMA, "disable_any_whitespace": True}
MESSAGES = [{"role": "user", "content": "Describe a pet as JSON."}]


@pytest.fixture(scope="module")
def server(tiny_llama_checkpoint: Path) -> Iterator[RemoteServer]:
    # At most 2 blanks between JSON tokens: the tiny model's context is 256 tokens.
    with running_server(tiny_llama_checkpoint, ["--plugin-option", "xgrammar.max_whitespace=2"],
                        served_model_name="tiny") as remote:
        yield remote


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    client: openai.OpenAI = server.client()
    return client


def _chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs.setdefault("max_tokens", 120)
    return client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0,
                                          **kwargs)


def _streamed_chat_text(client: openai.OpenAI, **kwargs: Any) -> tuple[str, str | None]:
    text, finish = "", None
    for chunk in _chat(client, stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


def test_response_format_json_schema_validates(client: openai.OpenAI) -> None:
    response = _chat(client, max_tokens=200, response_format={
        "type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}})
    choice = response.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_streamed_json_schema_is_the_same_output(client: openai.OpenAI) -> None:
    whole = _chat(client, extra_body={"structured_outputs": COMPACT_SCHEMA})
    text, finish = _streamed_chat_text(client, extra_body={"structured_outputs": COMPACT_SCHEMA})
    assert (text, finish) == (whole.choices[0].message.content, "stop")
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_is_an_object(client: openai.OpenAI) -> None:
    response = _chat(client, response_format={"type": "json_object"}, max_tokens=200)
    choice = response.choices[0]
    # The random model may never close the object; when it does, it is valid JSON.
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.message.content.lstrip().startswith("{")


@pytest.mark.parametrize("extra", [
    {"guided_regex": r"[a-c]{2}-\d{3}"},
    {"structured_outputs": {"regex": r"[a-c]{2}-\d{3}"}},
])
def test_completions_regex_matches(client: openai.OpenAI, extra: dict[str, Any]) -> None:
    response = client.completions.create(model="tiny", prompt="code:", max_tokens=20,
                                         temperature=0, extra_body=extra)
    assert re.fullmatch(r"[a-c]{2}-\d{3}", response.choices[0].text)
    assert response.choices[0].finish_reason == "stop"


def test_choice_streamed_and_not(client: openai.OpenAI) -> None:
    choices = ["sunny", "rainy", "snow storm"]
    whole = _chat(client, extra_body={"guided_choice": choices}).choices[0].message.content
    assert whole in choices
    assert _streamed_chat_text(client, extra_body={"structured_outputs": {
        "choice": choices}}) == (whole, "stop")


def test_grammar_with_n_and_sampling(client: openai.OpenAI) -> None:
    grammar = 'root ::= "x=" [0-9] [0-9]? ";"'
    response = client.completions.create(model="tiny", prompt="p", max_tokens=10, n=3,
                                         temperature=1.0, seed=7,
                                         extra_body={"guided_grammar": grammar})
    for choice in response.choices:
        assert re.fullmatch(r"x=\d\d?;", choice.text), choice.text


def test_unconstrained_requests_are_untouched(client: openai.OpenAI) -> None:
    plain = client.completions.create(model="tiny", prompt="hello", max_tokens=12,
                                      temperature=0).choices[0].text
    again = client.completions.create(model="tiny", prompt=["hello", "hello"], max_tokens=12,
                                      temperature=0, extra_body={}).choices
    assert [c.text for c in again] == [plain, plain]


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}}, "structured_outputs.json",
     "Unsupported type \"objectx\""),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "needs json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "must be one of"),
    ({"guided_regex": "a(b"}, "structured_outputs.regex", "parenthesis is not closed"),
    ({"guided_grammar": "root ::= nothing"}, "structured_outputs.grammar",
     "Rule \"nothing\" is not defined"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one of"),
    ({"structured_outputs": {"jsonn": {}}}, "structured_outputs.jsonn", "unknown field"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex",
     "both constrain"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "not supported"),
    ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend", "'xgrammar'"),
])
def test_a_bad_spec_is_a_400_naming_it(client: openai.OpenAI, extra: dict[str, Any],
                                       param: str, words: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, extra_body=extra)
    body = info.value.body
    assert isinstance(body, dict)
    assert body["param"] == param, body
    assert words in body["message"], body


def test_tool_choice_auto_needs_the_server_flags(client: openai.OpenAI) -> None:
    """This server runs without --enable-auto-tool-choice: a named choice still works."""
    tools = [{"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"pet": {"type": "string", "enum": ["cat", "dog"]}},
        "required": ["pet"]}}}]
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
        _chat(client, tools=tools)
    named = {"type": "function", "function": {"name": "pick"}}
    (call,) = _chat(client, tools=tools, tool_choice=named).choices[0].message.tool_calls
    assert call.function.name == "pick"
    assert json.loads(call.function.arguments)["pet"] in ("cat", "dog")
