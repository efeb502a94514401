"""One chat choice's tool calls, found in its text as a whole or as it streams.

``named``: the text is the arguments of the named function; it streams as argument
fragments of call 0 (the name and id in the first delta). ``required``: the text is a JSON
array of ``{"name", "parameters"}``; each element is sent once it is complete. ``auto``:
the ``--tool-call-parser`` decides (its ``extract_tool_calls`` on the whole text, its
streaming methods piece by piece). A parser that raises fails that request with a
``PluginError`` naming it (HTTP 500 ``plugin_error``, or an error frame when streaming).
"""

from __future__ import annotations

import functools

from engine.core.plugin_faults import call_plugin
from engine.sdk.groups import TOOL_PARSERS
from engine.sdk.tool_parser import (
    ExtractedToolCalls,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
)
from engine.server.tool_parsers._json_text import decode_object, skip
from engine.server.tools import (
    ToolParserSelection,
    ToolPlan,
    extract_calls,
    new_call_id,
    required_call,
)


class ChoiceTools:
    """Tool calls of one choice (see the module docstring).

    Args:
        plan: The request's tool plan.
        selection: The server's tool-call parser (needed for ``auto``).
    """

    def __init__(self, plan: ToolPlan, selection: ToolParserSelection | None) -> None:
        self.plan = plan
        self.parser: ToolParser | None = None
        if plan.choice == "auto" and selection is not None:
            self.parser = selection.new(plan.tools or ())
            self._error = functools.partial(selection.setup.catalog.error, TOOL_PARSERS,
                                            selection.name)
        self.called = False  # some call was reported (named: call 0 was opened)
        self._sent = 0  # required: array elements sent
        self._text = ""  # required: the text so far
        self._named_id = new_call_id()

    def final(self, text: str) -> ExtractedToolCalls:
        """The calls and remaining content of the whole text (ids filled in)."""
        if self.parser is None:
            found = extract_calls(self.plan, text, None)
        else:
            found = call_plugin("extract_tool_calls", extract_calls, self.plan, text,
                                self.parser, error=self._error)
        calls = tuple(call if call.id else ToolCall(call.name, call.arguments, new_call_id())
                      for call in found.tool_calls)
        self.called = bool(calls)
        return ExtractedToolCalls(tool_calls=calls, content=found.content)

    def advance(self, delta_text: str, finished: bool) -> StreamDelta | None:
        """What to stream for the next piece of text; with ``finished``, what is left too."""
        piece = self.feed(delta_text) if delta_text else None
        last = self.finish() if finished else None
        if last is None:
            return piece
        if piece is None:
            return last
        return StreamDelta(content=(piece.content or "") + (last.content or "") or None,
                           tool_calls=piece.tool_calls + last.tool_calls)

    def feed(self, delta_text: str) -> StreamDelta | None:
        """What to stream for the next piece of text."""
        if self.plan.choice == "named":
            assert self.plan.name is not None
            first = not self.called
            self.called = True
            return StreamDelta(tool_calls=(ToolCallDelta(
                index=0, id=self._named_id if first else None,
                name=self.plan.name if first else None, arguments=delta_text),))
        if self.plan.choice == "required":
            self._text += delta_text
            return self._required_elements()
        if self.parser is not None:
            return self._noted(call_plugin("extract_tool_calls_streaming",
                                           self.parser.extract_tool_calls_streaming,
                                           delta_text, error=self._error))
        return StreamDelta(content=delta_text) if delta_text else None

    def finish(self) -> StreamDelta | None:
        """What is left to stream when the choice ends."""
        if self.plan.choice == "named" and not self.called:
            return self.feed("")
        if self.parser is not None:
            return self._noted(call_plugin("finish_streaming", self.parser.finish_streaming,
                                           error=self._error))
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
        deltas = [ToolCallDelta(index=self._sent + offset, id=new_call_id(), name=call.name,
                                arguments=call.arguments)
                  for offset, item in enumerate(new) if (call := required_call(item))]
        self._sent = len(found)
        self.called = self.called or bool(deltas)
        return StreamDelta(tool_calls=tuple(deltas)) if deltas else None


def _complete_elements(text: str) -> list[dict[str, object]]:
    """The complete objects at the start of a JSON array that may still be growing.

    The ``required`` grammar makes every element an object; the scan stops at the first
    element that is not complete yet.
    """
    start = text.find("[")
    if start < 0:
        return []
    items: list[dict[str, object]] = []
    pos = start + 1
    while (decoded := decode_object(text, skip(text, pos, " \t\r\n,"))) is not None:
        item, pos = decoded
        items.append(item)
    return items
