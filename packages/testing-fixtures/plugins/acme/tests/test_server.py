"""A real ``engine serve`` (EngineCore in its own process) with this package's front-end
plugins selected: the tool parser, the IO processor, the structured-output backend and the
opt-in endpoint, each reached over HTTP; a server that does not select them is untouched."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.testing.server import RemoteServer, running_server

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = '<function=get_weather>{"city": "Paris"}</function>'
# The tiny model writes random text: a regex makes it write the call, token by token.
FORCE_CALL = {"structured_outputs": {"regex": r'<function=get_weather>\{"city": "Paris"\}'
                                              r"</function>"}}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
ARGS = ["--structured-outputs-backend", "acme_regex", "--enable-auto-tool-choice",
        "--tool-call-parser", "acme_function_tags", "--io-processor", "acme_classify"]


def env(**changes: str | None) -> dict[str, str]:
    """This process's environment with ``changes`` (``None``: unset)."""
    values = dict(os.environ)
    for key, value in changes.items():
        if value is None:
            values.pop(key, None)
        else:
            values[key] = value
    return values


@pytest.fixture(scope="module")
def server(tiny_qwen3: Path) -> Iterator[RemoteServer]:
    # Endpoints are opt-in: naming the distribution allows them (and everything else of it).
    with running_server(tiny_qwen3, ARGS,
                        env=env(ENGINE_PLUGINS="acme-engine-plugins")) as remote:
        yield remote


def chat(server: RemoteServer, **extra: Any) -> Any:
    return server.client().chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=64, temperature=0,
        extra_body=FORCE_CALL, **extra)


def test_tool_calls_are_parsed(server: RemoteServer) -> None:
    choice = chat(server, tools=TOOLS).choices[0]
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather", {"city": "Paris"})
    assert call.id.startswith("call_") and not choice.message.content
    assert choice.finish_reason == "tool_calls"


def test_tool_calls_are_parsed_when_streamed(server: RemoteServer) -> None:
    calls: dict[int, dict[str, str]] = {}
    content = ""
    for chunk in chat(server, tools=TOOLS, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or ():
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
    assert "<function" not in content
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Paris"})]


def test_without_tools_the_text_is_content(server: RemoteServer) -> None:
    message = chat(server).choices[0].message
    assert message.content == CALL and not message.tool_calls


def test_the_io_processor_serves_pooling(server: RemoteServer) -> None:
    response = httpx.post(server.url_for("pooling"), timeout=60, json={
        "texts": ["win a prize now", "lunch at noon?"], "labels": ["spam", "ham"]})
    assert response.status_code == 200, response.text
    labels = response.json()["labels"]
    assert len(labels) == 2 and set(labels) <= {"spam", "ham"}
    bad = httpx.post(server.url_for("pooling"), json={"texts": [], "labels": ["a", "b"]})
    assert bad.status_code == 400 and "texts" in bad.text


def test_the_endpoint_generates(server: RemoteServer) -> None:
    response = httpx.post(server.url_for("acme/v1/generate"), timeout=60,
                          json={"prompt": "Hello", "max_tokens": 5})
    assert response.status_code == 200, response.text
    body = response.json()
    assert len(body["token_ids"]) == 5 and body["finish_reason"] == "length"


def test_a_server_that_selects_none_of_them(tiny_qwen3: Path) -> None:
    with running_server(tiny_qwen3, env=env(ENGINE_PLUGINS=None)) as plain:
        # The endpoint is installed but not named: not loaded. No --io-processor: 404.
        assert httpx.post(plain.url_for("acme/v1/generate"),
                          json={"prompt": "Hello"}).status_code == 404
        pooling = httpx.post(plain.url_for("pooling"), json={"texts": ["x"]})
        assert pooling.status_code == 404 and "acme_classify" in pooling.text
        # No --tool-call-parser: the call is text, and xgrammar serves the regex.
        message = chat(plain).choices[0].message
        assert message.content == CALL and not message.tool_calls
