"""``engine.tool_parsers`` entry ``acme_function_tags``: ``<function=NAME>{...}</function>``.

The format of Llama 3.1's built-in "custom tool calling" prompt: each call is
``<function=NAME>`` followed by its arguments as one JSON object and ``</function>``,
anywhere in the output. Only functions the request offered count. The first
``<function=`` that is not such a call ends the calls: it and the text after it are
content, so a call once found stays found as the output grows (the streaming default of
the SDK relies on that).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from engine.sdk.tool_parser import ExtractedToolCalls, ToolCall, ToolParser, ToolParserContext

START, END = "<function=", "</function>"
_NAME = re.compile(r"[A-Za-z_][\w.-]*>")
_DECODER = json.JSONDecoder()


class FunctionTagParser(ToolParser):
    """``Sure. <function=get_weather>{"city": "Paris"}</function>`` -> one call + content."""

    tool_call_start = START

    def __init__(self, ctx: ToolParserContext, tools: Sequence[Mapping[str, Any]] = ()) -> None:
        super().__init__(ctx, tools)
        self.names = {tool.get("function", {}).get("name") for tool in self.tools}

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        calls: list[ToolCall] = []
        content: list[str] = []
        pos = 0
        while (start := text.find(START, pos)) >= 0:
            call, end = self._call_at(text, start + len(START))
            if call is None:
                break
            content.append(text[pos:start])
            calls.append(call)
            pos = end
        content.append(text[pos:])
        return ExtractedToolCalls(tuple(calls), "".join(content))

    def _call_at(self, text: str, pos: int) -> tuple[ToolCall | None, int]:
        """The call whose name starts at ``pos``, and the index after its ``</function>``."""
        name = _NAME.match(text, pos)
        if name is None or name.group()[:-1] not in self.names:
            return None, pos
        start = name.end()
        while start < len(text) and text[start].isspace():
            start += 1
        try:
            arguments, end = _DECODER.raw_decode(text, start)
        except ValueError:  # invalid JSON, or cut off by the end of the text
            return None, pos
        while end < len(text) and text[end].isspace():
            end += 1
        if not isinstance(arguments, dict) or not text.startswith(END, end):
            return None, pos
        return ToolCall(name.group()[:-1], json.dumps(arguments, ensure_ascii=False)), end + len(
            END)
