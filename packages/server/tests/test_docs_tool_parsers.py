"""docs/plugins/tool-parsers.md: its parser, its tests and its format samples hold.

The page's module is written to a temporary ``acme_plugins`` package; its test block runs
as written; the example parser is checked here too, on a richer output, whole and split at
every point; the ``text`` samples of the built-in formats parse into the calls the page
describes; the response sample is what the example parser gives for the page's text.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.sdk.tool_parser import ToolParser, ToolParserContext
from engine.server.tool_parsers import HermesToolParser, Llama3JsonToolParser
from engine.testing.docs import code_block, code_blocks, page_package, run_page_tests

PAGE = Path(__file__).resolve().parents[3] / "docs" / "plugins" / "tool-parsers.md"
FIRST_LINES = ["# src/acme_plugins/brackets.py", "# tests/test_brackets.py"]
CTX = ToolParserContext(plugin_name="brackets")
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
         for n in ("get_weather", "get_time")]


def test_every_python_block_is_run() -> None:
    assert sorted(b.splitlines()[0] for b in code_blocks(PAGE)) == sorted(FIRST_LINES)


@pytest.fixture(scope="module")
def brackets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[type[ToolParser]]:
    modules = {"brackets": code_block(PAGE, "# src/acme_plugins/brackets.py")}
    with page_package(tmp_path_factory.mktemp("docs"), "acme_plugins", modules):
        from acme_plugins.brackets import BracketToolParser

        yield BracketToolParser


def test_the_pages_tests_pass(brackets: type[ToolParser]) -> None:
    ran = run_page_tests(code_block(PAGE, "# tests/test_brackets.py"), "test_brackets.py")
    assert len(ran) == 3


def test_the_registration_names_the_example(brackets: type[ToolParser]) -> None:
    [toml] = [b for b in code_blocks(PAGE, "toml") if "engine.tool_parsers" in b]
    assert 'brackets = "acme_plugins.brackets:BracketToolParser"' in toml
    assert "--tool-call-parser brackets" in "".join(code_blocks(PAGE, "bash"))


SAMPLE = ('Checking both.\n[[call get_weather {"city": "Zürich"}]] and '
          '[[call get_time {"tz": "Europe/Zurich"}]]\nThen [[call get_weather {"city": ')


def _streamed(parser: ToolParser, deltas: list[str]) -> tuple[str, list[tuple[Any, ...]]]:
    sent = [parser.extract_tool_calls_streaming(d) for d in deltas]
    sent.append(parser.finish_streaming())
    pieces = [c for d in sent if d is not None for c in d.tool_calls]
    assert all(p.id is not None and p.name is not None for p in pieces)  # sent whole
    content = "".join(d.content or "" for d in sent if d is not None)
    return content, [(p.index, p.name, p.arguments) for p in pieces]


def test_the_example_parser_whole_and_streamed(brackets: type[ToolParser]) -> None:
    whole = brackets(CTX, TOOLS).extract_tool_calls(SAMPLE)
    expected = [(0, "get_weather", '{"city": "Zürich"}'),
                (1, "get_time", '{"tz": "Europe/Zurich"}')]
    assert [(i, c.name, c.arguments) for i, c in enumerate(whole.tool_calls)] == expected
    # The cut-off third call ends the calls: it is content, with the text between calls.
    assert whole.content == 'Checking both.\n and \nThen [[call get_weather {"city": '
    for cut in range(len(SAMPLE) + 1):
        content, calls = _streamed(brackets(CTX, TOOLS), [SAMPLE[:cut], SAMPLE[cut:]])
        assert (content, calls) == (whole.content, expected), cut
    content, calls = _streamed(brackets(CTX, TOOLS), list(SAMPLE))
    assert (content, calls) == (whole.content, expected)


def test_the_example_ignores_functions_the_request_did_not_offer(
    brackets: type[ToolParser],
) -> None:
    text = '[[call get_weather {"city": "Paris"}]]'
    assert not brackets(CTX, TOOLS[1:]).extract_tool_calls(text).tools_called


def test_the_response_sample_is_the_examples_result(brackets: type[ToolParser]) -> None:
    [sample] = [json.loads(b) for b in code_blocks(PAGE, "json") if "tool_calls" in b]
    text = 'Let me look. [[call get_weather {"city": "Paris"}]]'
    result = brackets(CTX, TOOLS).extract_tool_calls(text)
    assert sample["content"] == result.content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in sample["tool_calls"]] \
        == [(c.name, c.arguments) for c in result.tool_calls]


def _sample(marker: str) -> str:
    [text] = [b for b in code_blocks(PAGE, "text") if marker in b]
    return text


def test_the_hermes_sample_parses_as_described() -> None:
    result = HermesToolParser(CTX).extract_tool_calls(_sample("I'll look both up."))
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Zürich"})]
    assert result.content is not None and result.content.strip() == "I'll look both up."


def test_the_llama3_sample_parses_as_described() -> None:
    result = Llama3JsonToolParser(CTX).extract_tool_calls(_sample("<|python_tag|>"))
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris"})]
    assert result.content is None
