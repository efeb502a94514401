"""One chat choice's tool calls, found in its text as a whole or as it streams.

``named``: the text is the arguments of the named function; it streams as argument
fragments of call 0 (the name and id in the first delta). ``required``: the text is a JSON
array of ``{"name", "parameters"}``; each element is sent once it is complete. ``auto``:
the ``--tool-call-parser`` decides (its ``extract_tool_calls`` on the whole text, its
streaming methods piece by piece). A parser that raises fails that request with a
``PluginError`` naming it (HTTP 500 ``plugin_error``, or an error frame when streaming).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from engine.sdk.errors import PluginError
from engine.sdk.groups import TOOL_PARSERS
from engine.sdk.tool_parser import (
    ExtractedToolCalls,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
)
from engine.server.tools import ToolParserSelection, ToolPlan, extract_calls, new_call_id


class ChoiceTools:
    """Tool calls of one choice (see the module docstring).

    Args:
        plan: The request's tool plan.
        selection: The server's tool-call parser (needed for ``auto``).
    """

    def __init__(self, plan: ToolPlan, selection: ToolParserSelection | None) -> None:
        self.plan = plan
        self.selection = selection
        self.parser: ToolParser | None = None
        if plan.choice == "auto" and selection is not None:
            self.parser = selection.new(plan.tools or ())
        self.called = False  # some call was reported
        self._sent = 0  # required: elements sent; named: whether call 0 was opened
        self._text = ""
        self._named_id = new_call_id()

    def _guard(self, hook: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except PluginError:
            raise
        except Exception as exc:
            assert self.selection is not None
            setup = self.selection.setup
            raise setup.catalog.error(TOOL_PARSERS, self.selection.name,
                                      f"{hook} raised {type(exc).__name__}: {exc}") from exc

    def final(self, text: str) -> ExtractedToolCalls:
        """The calls and remaining content of the whole text (ids filled in)."""
        found: ExtractedToolCalls = self._guard(
            "extract_tool_calls", lambda: extract_calls(self.plan, text, self.parser))
        calls = tuple(call if call.id else ToolCall(call.name, call.arguments, new_call_id())
                      for call in found.tool_calls)
        self.called = bool(calls)
        return ExtractedToolCalls(tool_calls=calls, content=found.content)

    def feed(self, delta_text: str) -> StreamDelta | None:
        """What to stream for the next piece of text."""
        if self.plan.choice == "named":
            assert self.plan.name is not None
            first = not self._sent
            self._sent = 1
            self.called = True
            return StreamDelta(tool_calls=(ToolCallDelta(
                index=0, id=self._named_id if first else None,
                name=self.plan.name if first else None, arguments=delta_text),))
        if self.plan.choice == "required":
            self._text += delta_text
            return self._required_elements()
        if self.parser is not None:
            parser = self.parser
            delta: StreamDelta | None = self._guard(
                "extract_tool_calls_streaming",
                lambda: parser.extract_tool_calls_streaming(delta_text))
            return self._noted(delta)
        return StreamDelta(content=delta_text) if delta_text else None

    def finish(self) -> StreamDelta | None:
        """What is left to stream when the choice ends."""
        if self.plan.choice == "named" and not self._sent:
            return self.feed("")
        if self.parser is not None:
            parser = self.parser
            return self._noted(self._guard("finish_streaming", parser.finish_streaming))
        return None

    def _noted(self, delta: StreamDelta | None) -> StreamDelta | None:
        if delta is not None and delta.tool_calls:
            self.called = True
        return delta

    def _required_elements(self) -> StreamDelta | None:
        """The array elements completed since the last call, as whole calls."""
        found = _complete_elements(self._text)
        if not self.plan.parallel:
            found = found[:1]
        new = found[self._sent:]
        if not new:
            return None
        deltas = []
        for offset, item in enumerate(new):
            name = item.get("name") if isinstance(item, dict) else None
            if not isinstance(name, str):
                continue
            arguments = item.get("parameters", item.get("arguments", {}))
            deltas.append(ToolCallDelta(index=self._sent + offset, id=new_call_id(), name=name,
                                        arguments=json.dumps(arguments, ensure_ascii=False)))
        self._sent = len(found)
        self.called = self.called or bool(deltas)
        return StreamDelta(tool_calls=tuple(deltas)) if deltas else None


def _complete_elements(text: str) -> list[Any]:
    """The complete elements at the start of a JSON array that may still be growing."""
    decoder = json.JSONDecoder()
    start = text.find("[")
    if start < 0:
        return []
    items: list[Any] = []
    pos = start + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return items
        try:
            item, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return items
        items.append(item)
