"""``hermes``: Hermes 2 Pro / Qwen-style ``<tool_call>`` blocks (vLLM's ``hermes`` parser).

The format (NousResearch Hermes 2 Pro, Qwen 2.5 and 3, and many fine-tunes)::

    I'll look both up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Zürich"}}
    </tool_call>

Each block holds one JSON object with ``name`` and ``arguments``; the arguments are sent
re-serialised (``json.dumps(arguments, ensure_ascii=False)``, as vLLM's
``Hermes2ProToolParser`` does). As in vLLM, the last block may lack ``</tool_call>`` (the
output ended, e.g. at a stop token) and still counts when its JSON is complete, and the
content is the text before the first ``<tool_call>``.

Where the output is not that tidy, nothing is lost and nothing raises: a block whose JSON
does not parse, or has no ``name``, stays in the content as written (vLLM drops every call
of the output then), and text after a block is content too unless it is only whitespace
(vLLM's streaming sends it, its non-streaming path drops it). ``arguments`` may be missing
(``{}``). A block runs from its ``<tool_call>`` to the next ``</tool_call>``, or to the
next ``<tool_call>`` or the end of the output if none comes first; JSON is decoded in
place, so a ``</tool_call>`` inside an argument string does not end the block.
"""

from __future__ import annotations

from engine.sdk.tool_parser import ExtractedToolCalls, ToolCall, ToolParser
from engine.server.tool_parsers._json_text import call_from_object, decode_object

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks; see the module."""

    tool_call_start = START

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        calls: list[ToolCall] = []
        outside: list[str] = []  # the content, in pieces
        pos = 0
        while (start := text.find(START, pos)) >= 0:
            _add_gap(outside, text[pos:start])
            call, pos = _block(text, start + len(START))
            if call is None:
                outside.append(text[start:pos])
            else:
                calls.append(call)
        _add_gap(outside, text[pos:])
        return ExtractedToolCalls(tuple(calls), "".join(outside))


def _add_gap(outside: list[str], gap: str) -> None:
    """Add text between blocks to the content; whitespace between blocks is no content."""
    if gap.strip() or not outside:  # the text before the first block is kept as written
        outside.append(gap)


def _block(text: str, body: int) -> tuple[ToolCall | None, int]:
    """The call of the block whose body starts at ``body`` (or ``None``), and its end."""
    found = decode_object(text, body)
    call = None if found is None else call_from_object(found[0], ("arguments",),
                                                       require_arguments=False)
    # After a call, search from the end of its JSON: a tag inside a string is no tag.
    return call, _block_end(text, body if found is None or call is None else found[1])


def _block_end(text: str, pos: int) -> int:
    """After the next ``</tool_call>``; else at the next ``<tool_call>``; else the end."""
    close = text.find(END, pos)
    reopen = text.find(START, pos)
    if close >= 0 and (reopen < 0 or close < reopen):
        return close + len(END)
    return reopen if reopen >= 0 else len(text)
