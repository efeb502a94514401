"""``llama3_json``: Llama 3.1+ JSON tool calls (vLLM's ``llama3_json`` parser).

The format (Llama 3.1, 3.2 and 3.3 with JSON-based tool calling, optionally opened by the
``<|python_tag|>`` special token)::

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

One or more JSON objects with ``name`` and ``parameters`` (``arguments`` is accepted too),
separated by ``;`` and/or whitespace. As in vLLM's ``Llama3JsonToolParser``: the output is
tool calls only when it starts (after whitespace and the optional ``<|python_tag|>``) with
``{``, otherwise it is all content; the arguments are sent re-serialised
(``json.dumps(parameters, ensure_ascii=False)``); and the content is ``None`` when calls
were found.

Where the output is not that tidy, nothing raises: the calls are the leading objects that
describe a call; what follows the first one that does not (invalid JSON, an object without
``name`` or without arguments, prose) is the content (vLLM makes all of the output content
then). Output with no call at all (``{"answer": 42}``, a ``<|python_tag|>`` code call) is
content as written.
"""

from __future__ import annotations

from engine.sdk.tool_parser import ExtractedToolCalls, ToolCall, ToolParser
from engine.server.tool_parsers._json_text import call_from_object, decode_object, skip

PYTHON_TAG = "<|python_tag|>"
_SEPARATORS = " \t\r\n;"


class Llama3JsonToolParser(ToolParser):
    """``{"name": ..., "parameters": {...}}`` objects separated by ``;``; see the module."""

    tool_call_start = PYTHON_TAG

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        start = self._starts_tool_call(text)
        if start is None:
            return ExtractedToolCalls(content=text)
        pos = start + len(PYTHON_TAG) if text.startswith(PYTHON_TAG, start) else start
        calls: list[ToolCall] = []
        while True:
            pos = skip(text, pos, _SEPARATORS)
            found = decode_object(text, pos)
            call = None if found is None else call_from_object(
                found[0], ("arguments", "parameters"), require_arguments=True)
            if found is None or call is None:
                break
            calls.append(call)
            pos = found[1]
        if not calls:
            return ExtractedToolCalls(content=text)
        return ExtractedToolCalls(tuple(calls), text[pos:])

    def _starts_tool_call(self, text: str) -> int | None:
        """Tool text only at the very start: ``{`` or ``<|python_tag|>`` after whitespace."""
        stripped = text.lstrip()
        if stripped.startswith((PYTHON_TAG, "{")):
            return len(text) - len(stripped)
        return None
