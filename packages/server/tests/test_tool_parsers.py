"""The built-in tool parsers (``hermes``, ``llama3_json``) and the SDK's streaming default.

The unit tests feed realistic model outputs to ``extract_tool_calls``. The streaming tests
check the contract's invariant: for any split of an output into deltas, the streamed
content and calls are those of ``extract_tool_calls`` on the whole output. Short texts are
split at every point (two deltas, and one character per delta); longer ones into random
chunks with a fixed seed.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable, Sequence
from importlib.metadata import entry_points

import pytest

from engine.sdk.tool_parser import (
    ExtractedToolCalls,
    StreamDelta,
    ToolCall,
    ToolParser,
    ToolParserContext,
)
from engine.server.tool_parsers import HermesToolParser, Llama3JsonToolParser

CTX = ToolParserContext(plugin_name="test")
ID = re.compile(r"call_[0-9a-f]{24}")


def calls(result: ExtractedToolCalls) -> list[tuple[str, object]]:
    """(name, decoded arguments) of each call: independent of JSON spacing."""
    return [(c.name, json.loads(c.arguments)) for c in result.tool_calls]


def hermes(text: str) -> ExtractedToolCalls:
    return HermesToolParser(CTX).extract_tool_calls(text)


def llama3(text: str) -> ExtractedToolCalls:
    return Llama3JsonToolParser(CTX).extract_tool_calls(text)


# --- the SDK types -------------------------------------------------------------------


def test_whitespace_content_is_none_and_calls_are_a_tuple() -> None:
    result = ExtractedToolCalls([ToolCall("f", "{}")], content=" \n\t")  # type: ignore[arg-type]
    assert result.content is None and result.tool_calls == (ToolCall("f", "{}"),)
    assert result.tools_called and not ExtractedToolCalls(content="hi").tools_called


def test_a_parser_must_implement_extract_tool_calls() -> None:
    class Incomplete(ToolParser):
        pass

    with pytest.raises(TypeError, match="extract_tool_calls"):
        Incomplete(CTX)  # type: ignore[abstract]


def test_the_context_says_front_end_and_keeps_the_tools() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    parser = HermesToolParser(ToolParserContext(tokenizer="tok"), tools)
    assert parser.ctx.process == "frontend" and parser.ctx.tokenizer == "tok"
    assert parser.tools == tuple(tools)


def test_the_built_ins_are_registered_entry_points() -> None:
    found = {e.name: e.load() for e in entry_points(group="engine.tool_parsers")
             if e.value.startswith("engine.server.")}
    assert found == {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


# --- hermes --------------------------------------------------------------------------

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'


def test_hermes_one_call() -> None:
    result = hermes(f"<tool_call>\n{WEATHER}\n</tool_call>")
    assert calls(result) == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert result.tool_calls[0].arguments == '{"city": "Paris", "unit": "celsius"}'
    assert result.content is None and result.tool_calls[0].id is None


def test_hermes_two_calls_with_content_before() -> None:
    text = ("I'll check both cities.\n\n<tool_call>\n" + WEATHER + "\n</tool_call>\n"
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
    result = hermes(text)
    assert [name for name, _ in calls(result)] == ["get_weather", "get_weather"]
    assert calls(result)[1][1] == {"city": "Rome"}
    assert result.content == "I'll check both cities.\n\n"


def test_hermes_no_call_is_all_content() -> None:
    result = hermes("The weather in Paris is sunny.")
    assert not result.tools_called and result.content == "The weather in Paris is sunny."
    assert hermes("").content is None


def test_hermes_unterminated_last_call_counts_when_its_json_is_complete() -> None:
    result = hermes(f"<tool_call>{WEATHER}</tool_call>\n<tool_call>\n"
                    '{"name": "get_time", "arguments": {"tz": "UTC"}}\n')
    assert calls(result) == [("get_weather", {"city": "Paris", "unit": "celsius"}),
                             ("get_time", {"tz": "UTC"})]
    assert result.content is None


def test_hermes_cut_off_call_is_content_not_a_call() -> None:
    text = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UT'
    assert hermes(text) == ExtractedToolCalls(content=text)


@pytest.mark.parametrize("bad", [
    '{"name": "get_time", "arguments": {"tz": }}',  # invalid JSON
    '{"arguments": {"tz": "UTC"}}',  # no name
    '["get_time"]',  # not an object
    "get_time(tz='UTC')",  # not JSON at all
])
def test_hermes_malformed_call_is_left_as_content(bad: str) -> None:
    text = f"Sure.\n<tool_call>\n{bad}\n</tool_call>\n<tool_call>\n{WEATHER}\n</tool_call>"
    result = hermes(text)
    assert [name for name, _ in calls(result)] == ["get_weather"]
    assert result.content == f"Sure.\n<tool_call>\n{bad}\n</tool_call>"


def test_hermes_non_ascii_arguments_are_kept_as_is() -> None:
    result = hermes('<tool_call>{"name": "translate", "arguments": '
                    '{"text": "Grüße aus Zürich", "to": "日本語"}}</tool_call>')
    assert result.tool_calls[0].arguments == '{"text": "Grüße aus Zürich", "to": "日本語"}'


def test_hermes_tags_inside_argument_strings_do_not_end_the_call() -> None:
    args = {"html": "<b></tool_call><tool_call></b>"}
    result = hermes('<tool_call>{"name": "render", "arguments": ' + json.dumps(args)
                    + "}</tool_call>")
    assert calls(result) == [("render", args)] and result.content is None


def test_hermes_missing_arguments_are_empty_and_text_after_the_calls_is_content() -> None:
    result = hermes('<tool_call>{"name": "get_time"}</tool_call>\nDone.')
    assert calls(result) == [("get_time", {})] and result.content == "\nDone."


# --- llama3_json ---------------------------------------------------------------------

PARIS = '{"name": "get_weather", "parameters": {"city": "Paris"}}'


def test_llama3_one_call() -> None:
    result = llama3(PARIS)
    assert calls(result) == [("get_weather", {"city": "Paris"})] and result.content is None


def test_llama3_python_tag_and_leading_whitespace() -> None:
    assert calls(llama3(f"\n <|python_tag|>{PARIS}")) == [("get_weather", {"city": "Paris"})]


def test_llama3_semicolon_separated_calls() -> None:
    text = f'<|python_tag|>{PARIS}; {{"name": "get_time", "arguments": {{"tz": "UTC"}}}};'
    result = llama3(text)
    assert calls(result) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]
    assert result.content is None
    assert calls(llama3(f"{PARIS}\n{PARIS}")) == 2 * [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("text", [
    "The weather in Paris is sunny.",
    f"Here you go: {PARIS}",  # not at the start: prose that quotes JSON
    '{"answer": 42}',  # JSON, but no call
    '{"name": "Ada Lovelace"}',  # a name without parameters is data, not a call
    '{"name": "get_weather", "parameters": {"city": ',  # cut off
    "<|python_tag|>print(sum(range(10)))",  # a code-interpreter call, not JSON
])
def test_llama3_text_without_a_call_is_all_content(text: str) -> None:
    assert llama3(text) == ExtractedToolCalls(content=text)


def test_llama3_what_follows_the_calls_is_content() -> None:
    result = llama3(f"{PARIS}; oops, that was wrong")
    assert calls(result) == [("get_weather", {"city": "Paris"})]
    assert result.content == "oops, that was wrong"


def test_llama3_non_ascii_arguments_are_kept_as_is() -> None:
    result = llama3('{"name": "get_weather", "parameters": {"city": "Zürich"}}')
    assert result.tool_calls[0].arguments == '{"city": "Zürich"}'


# --- streaming -----------------------------------------------------------------------


class LineParser(ToolParser):
    """A marker-less format for the defaults: ``CALL name {json}`` lines are calls.

    The rest of a call's line is ignored, so that a call, once complete, stays a call.
    """

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        decoder = json.JSONDecoder()
        found: list[ToolCall] = []
        content: list[str] = []
        for line in text.splitlines(keepends=True):
            match = re.match(r"\s*CALL (\w+) ", line)
            try:
                arguments, _ = decoder.raw_decode(line, match.end()) if match else ({}, 0)
            except ValueError:
                match = None
            if match:
                found.append(ToolCall(match.group(1), json.dumps(arguments)))
            else:
                content.append(line)
        return ExtractedToolCalls(tuple(found), "".join(content))


def stream(parser: ToolParser, deltas: Iterable[str]) -> list[StreamDelta]:
    sent = [parser.extract_tool_calls_streaming(d) for d in deltas]
    sent.append(parser.finish_streaming())
    return [d for d in sent if d is not None]


def collect(deltas: Sequence[StreamDelta]) -> tuple[str, list[tuple[str, str]], list[str]]:
    """(content, [(name, arguments)], ids) as a client assembles them from the deltas."""
    content = "".join(d.content or "" for d in deltas)
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    ids: dict[int, str] = {}
    for d in deltas:
        for piece in d.tool_calls:
            if piece.name is not None:
                names.setdefault(piece.index, piece.name)
            if piece.id is not None:
                ids.setdefault(piece.index, piece.id)
            arguments[piece.index] = arguments.get(piece.index, "") + piece.arguments
    assert sorted(names) == list(range(len(names))) == sorted(ids), "ids and names first"
    return content, [(names[i], arguments[i]) for i in sorted(names)], [ids[i] for i in
                                                                         sorted(ids)]


def check_split(parser_class: type[ToolParser], text: str, deltas: list[str]) -> None:
    assert "".join(deltas) == text
    whole = parser_class(CTX).extract_tool_calls(text)
    content, streamed, ids = collect(stream(parser_class(CTX), deltas))
    assert content.strip() == (whole.content or "").strip(), deltas
    assert streamed == [(c.name, c.arguments) for c in whole.tool_calls], deltas
    assert all(ID.fullmatch(i) for i in ids) and len(set(ids)) == len(ids)


def splits(text: str, seed: int) -> Iterable[list[str]]:
    """Every two-piece split, one character per delta, and random chunkings."""
    if len(text) <= 120:
        for cut in range(len(text) + 1):
            yield [text[:cut], text[cut:]]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(30):
        deltas, pos = [], 0
        while pos < len(text):
            size = rng.randint(1, 12)
            deltas.append(text[pos:pos + size])
            pos += size
        yield deltas


HERMES_TEXTS = [
    f"<tool_call>{WEATHER}</tool_call>",
    f"Sure!<tool_call>\n{WEATHER}\n</tool_call>",
    f"Checking.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n"
    '{"name": "get_time", "arguments": {"tz": "Europe/Zürich"}}\n</tool_call>\nDone.',
    f'<tool_call>{{"name": 1}}</tool_call>\n<tool_call>{WEATHER}',
    '<tool_call>{"name": "render", "arguments": {"html": "</tool_call><tool_call>"}}'
    "</tool_call>",
    "no calls here, just <tool_ and <tool_call-ish text",
    "a cut-off call: <tool_call>{\"name\": \"get_time\", \"argu",
    "<tool_x>not a tag</tool_x> <",
    "   \n",
]
LLAMA3_TEXTS = [
    PARIS,
    f"\n\n<|python_tag|>{PARIS}; {PARIS}",
    f'{PARIS};{{"name": "get_time", "arguments": {{"tz": "日本"}}}}; trailing words',
    "The answer is {42}.",
    "<|python_tag|>print('hi')",
    '{"answer": 42}',
    " <|pyth",
    "",
]
LINE_TEXTS = [
    'CALL get_weather {"city": "Paris"}',
    'Let me see.\nCALL get_weather {"city": "Paris"}\nCALL get_time {}\nThat is all.',
    "CALL broken {not json}\nplain text",
    "  \n",
]


@pytest.mark.parametrize(("parser_class", "text"), [
    *((HermesToolParser, t) for t in HERMES_TEXTS),
    *((Llama3JsonToolParser, t) for t in LLAMA3_TEXTS),
    *((LineParser, t) for t in LINE_TEXTS),
])
def test_streaming_matches_the_whole_output_for_any_split(parser_class: type[ToolParser],
                                                          text: str) -> None:
    for deltas in splits(text, seed=len(text)):
        check_split(parser_class, text, deltas)


def test_a_marker_split_across_deltas_is_not_leaked_as_content() -> None:
    parser = HermesToolParser(CTX)
    first = parser.extract_tool_calls_streaming("Let me check. <tool_")
    assert first == StreamDelta(content="Let me check. ")
    second = parser.extract_tool_calls_streaming(f"call>{WEATHER}")
    assert second is not None and second.content is None
    [call] = second.tool_calls
    assert (call.index, call.name) == (0, "get_weather") and ID.fullmatch(call.id or "")
    assert parser.extract_tool_calls_streaming("</tool_call>") is None
    assert parser.finish_streaming() is None


def test_text_that_only_starts_like_the_marker_is_sent_eventually() -> None:
    parser = HermesToolParser(CTX)
    assert parser.extract_tool_calls_streaming("Use <tool_") == StreamDelta(content="Use ")
    assert parser.extract_tool_calls_streaming("x> tags") == StreamDelta(content="<tool_x> tags")
    assert parser.extract_tool_calls_streaming(" or <t") == StreamDelta(content=" or ")
    assert parser.finish_streaming() == StreamDelta(content="<t")  # held back until the end


def test_streamed_ids_are_stable_and_a_parsers_own_id_is_kept() -> None:
    class WithIds(LineParser):
        def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
            found = super().extract_tool_calls(text)
            first = [ToolCall(c.name, c.arguments, id="mine") for c in found.tool_calls[:1]]
            return ExtractedToolCalls((*first, *found.tool_calls[1:]), found.content)

    parser = WithIds(CTX)
    deltas = stream(parser, ["CALL a {}\nCALL b {", "}\n", "CALL c {}"])
    _, streamed, ids = collect(deltas)
    assert [name for name, _ in streamed] == ["a", "b", "c"]
    assert ids[0] == "mine" and all(ID.fullmatch(i) for i in ids[1:])
    assert parser._call_id(1, ToolCall("b", "{}")) == ids[1]  # one id per call and instance
