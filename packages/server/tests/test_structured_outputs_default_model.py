"""Structured outputs and a named tool call on the built-in default model (SmolLM2-135M).

A real instruct model with a 49,152-token vocabulary: its JSON validates against the schema
and stops by itself, and a named tool choice gives the schema's arguments.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from engine.core.model_loader.default_model import default_model_path
from engine.testing.server import running_server

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20},
                   "country": {"type": "string", "maxLength": 20},
                   "population_millions": {"type": "number"}},
    "required": ["city", "country", "population_millions"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    with running_server(default_model_path(), ["--max-model-len", "512"],
                        served_model_name="smol") as remote:
        yield remote.client()


def _ask(client: openai.OpenAI, **kwargs: object) -> object:
    return client.chat.completions.create(
        model="smol", temperature=0, max_tokens=80,
        messages=[{"role": "user", "content": "Give the capital of France as JSON."}],
        **kwargs)  # type: ignore[call-overload]


def test_json_schema_on_the_default_model(client: openai.OpenAI) -> None:
    response = _ask(client, response_format={"type": "json_schema", "json_schema": {
        "name": "capital", "schema": SCHEMA}})
    choice = response.choices[0]  # type: ignore[attr-defined]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_named_tool_call_on_the_default_model(client: openai.OpenAI) -> None:
    tools = [{"type": "function", "function": {"name": "lookup_capital", "parameters": SCHEMA}}]
    response = _ask(client, tools=tools, tool_choice={"type": "function", "function": {
        "name": "lookup_capital"}})
    (call,) = response.choices[0].message.tool_calls  # type: ignore[attr-defined]
    assert call.function.name == "lookup_capital"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
