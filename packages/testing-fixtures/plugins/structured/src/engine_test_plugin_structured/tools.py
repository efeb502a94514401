"""A tool-call parser that proves the ``engine.tool_parsers`` seam is reached.

``test_echo`` reads ``CALL:<text>;`` in the output as one call of the request's first
tool, with ``{"text": "<text>"}`` as its arguments; the text before it is content, and a
call without its ``;`` is not complete yet (so not a call). It relies on the SDK's default
streaming (``tool_call_start = "CALL:"``), and says it ran by giving each call the id
``echo_<length of text>``. The text ``fail`` makes it raise (a plugin fault on demand).
"""

from __future__ import annotations

import json

from engine.sdk.tool_parser import ExtractedToolCalls, ToolCall, ToolParser

MARKER = "CALL:"


class EchoToolParser(ToolParser):
    """``CALL:<text>;`` -> one call of the first tool with ``{"text": "<text>"}``."""

    tool_call_start = MARKER

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        start = text.find(MARKER)
        end = text.find(";", start + len(MARKER)) if start >= 0 else -1
        if end < 0 or not self.tools:
            return ExtractedToolCalls(content=text)
        name = self.tools[0]["function"]["name"]
        rest = text[start + len(MARKER):end]
        if rest == "fail":
            raise RuntimeError("asked to fail")
        call = ToolCall(name=name, arguments=json.dumps({"text": rest}),
                        id=f"echo_{len(rest)}")
        return ExtractedToolCalls(tool_calls=(call,), content=text[:start] or None)
