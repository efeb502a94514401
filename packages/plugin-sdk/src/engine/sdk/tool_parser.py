"""``ToolParser``: read the tool calls a chat model wrote as text back into structured calls.

A chat model given ``tools`` writes its calls in a text format of its own: Hermes-style
models ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, Llama 3 a bare JSON
object. The parser the operator selects (``engine serve --enable-auto-tool-choice
--tool-call-parser NAME``, group ``engine.tool_parsers``) turns that text into OpenAI
``tool_calls``. It runs in the front end only, one instance per chat completion request
that has ``tools``, built with the request's tool definitions:

* non-streaming: :meth:`ToolParser.extract_tool_calls` on the whole output;
* streaming: :meth:`ToolParser.extract_tool_calls_streaming` with each new piece of text,
  in order, then :meth:`ToolParser.finish_streaming` once. The base class implements both
  on top of ``extract_tool_calls``, so a parser usually writes that one method.

.. versionadded:: 1.1
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar
from uuid import uuid4

from engine.sdk.context import PluginContext
from engine.sdk.plugin import Plugin


@dataclass(frozen=True)
class ToolCall:
    """One complete tool call found in the model's output.

    Attributes:
        name: The function's name, as the model wrote it.
        arguments: The arguments object as JSON text (OpenAI's ``function.arguments``),
            e.g. ``'{"city": "Paris"}'``.
        id: The call's id; ``None`` lets the engine assign one (``call_`` + 24 hex digits).

    .. versionadded:: 1.1
    """

    name: str
    arguments: str
    id: str | None = None


@dataclass(frozen=True)
class ExtractedToolCalls:
    """What :meth:`ToolParser.extract_tool_calls` found in a text.

    Attributes:
        tool_calls: The complete calls, in the order the model wrote them.
        content: The text outside the calls, or ``None`` when there is none. Empty and
            whitespace-only text is stored as ``None``.

    .. versionadded:: 1.1
    """

    tool_calls: tuple[ToolCall, ...] = ()
    content: str | None = None

    def __post_init__(self) -> None:
        # Normalised here, so that no parser has to: a list of calls is kept as a tuple,
        # and content that is only whitespace is no content.
        object.__setattr__(self, "tool_calls", tuple(self.tool_calls))
        if self.content is not None and not self.content.strip():
            object.__setattr__(self, "content", None)

    @property
    def tools_called(self) -> bool:
        """Whether at least one call was found.

        .. versionadded:: 1.1
        """
        return bool(self.tool_calls)


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of one streamed call: OpenAI's ``delta.tool_calls[i]``.

    Attributes:
        index: Which call (0 for the first call of the output, 1 for the next, ...).
        id: The call's id, sent with the first piece of that call.
        name: The function's name, sent with the first piece of that call.
        arguments: Text to append to that call's arguments (the default streaming sends
            the whole JSON text at once).

    .. versionadded:: 1.1
    """

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class StreamDelta:
    """What one streaming step adds: content text, pieces of calls, or both.

    .. versionadded:: 1.1
    """

    content: str | None = None
    tool_calls: tuple[ToolCallDelta, ...] = ()


@dataclass(frozen=True, kw_only=True)
class ToolParserContext(PluginContext):
    """What a tool parser is told.

    Attributes:
        tokenizer: The served model's tokenizer (a ``transformers`` tokenizer), for parsers
            that need its special tokens; ``None`` where there is none (tests).

    .. versionadded:: 1.1
    """

    process: str = "frontend"
    tokenizer: Any = None


class ToolParser(Plugin, ABC):
    """Tool calls out of model text, selected with ``--tool-call-parser NAME`` (front end).

    Subclasses implement :meth:`extract_tool_calls` and set :attr:`tool_call_start`; the
    streaming methods have a default built on those two (overriding ``__init__``: call
    ``super().__init__(ctx, tools)``, which sets up the streaming state).

    Streaming default, for one output::

        "Let me check.<tool_call>{"name": "f", "arguments": {}}</tool_call>"
         |- content --||--------------- tool text ------------------------|
                       ^ _starts_tool_call(text so far)

        before the start  each delta's text goes out as content, except a trailing part
                          that could begin tool_call_start ("<tool_"): held back until
                          later text shows it does not (then sent) or does (tool text)
        after the start   no content; after each delta extract_tool_calls(tool text) runs
                          and every call beyond those already sent goes out whole, as one
                          ToolCallDelta(index, id, name, arguments=<all its JSON>)
        finish_streaming  the calls not yet sent, any held-back text, and the content that
                          extract_tool_calls(tool text) reports

    So for any split of an output into deltas, the streamed content and calls are those of
    ``extract_tool_calls(output)`` (content up to leading and trailing whitespace),
    provided the parser keeps the two rules on :meth:`extract_tool_calls` and
    :meth:`_starts_tool_call`. Each call of an instance keeps one id: the parser's, or
    ``call_`` + 24 hex digits. Cost: one ``extract_tool_calls`` over the tool text per
    delta; a parser for very long tool text may override the streaming methods.

    Attributes:
        tool_call_start: The text that opens tool-call text (``"<tool_call>"``), or
            ``None`` when the format has no marker: then the default treats all output
            from its first non-whitespace character on as tool text, and sends content
            only at :meth:`finish_streaming`.
        ctx: The context the parser was built with.
        tools: The request's tool definitions, OpenAI-shaped: ``{"type": "function",
            "function": {"name", "description", "parameters"}}``.

    .. versionadded:: 1.1
    """

    tool_call_start: ClassVar[str | None] = None

    def __init__(self, ctx: ToolParserContext, tools: Sequence[Mapping[str, Any]] = ()) -> None:
        self.ctx = ctx
        self.tools: tuple[Mapping[str, Any], ...] = tuple(tools)
        self._text = ""  # everything streamed so far
        self._num_content_chars = 0  # of _text sent as content (all before the tool text)
        self._tool_start: int | None = None  # where in _text the tool text starts
        self._num_sent_calls = 0
        self._call_ids: dict[int, str] = {}

    @abstractmethod
    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """Find the tool calls in ``text`` and the content outside them.

        Called: in the front end, once per non-streaming request with the whole output;
        by the default streaming after every delta, with the tool text so far.

        Args:
            text: Model output: the whole of it, or (streaming) the part from the tool
                text's start on, possibly cut anywhere.

        Returns:
            The complete calls and the content. Text that looks like a call but does not
            parse is content, not an error.

        Must: never raise on model output, however odd; return only complete calls (a call
        cut off by the end of ``text`` is not returned); be deterministic and stable under
        extension: the calls found in a text are the first calls found in any longer text
        starting with it (streaming sends a call as soon as it is found).

        .. versionadded:: 1.1
        """

    def extract_tool_calls_streaming(self, delta_text: str) -> StreamDelta | None:
        """Take the next piece of output; return what to send for it, or ``None``.

        Called: in the front end, once per new piece of a streamed choice's text, in order,
        with the text only (not the whole so far).
        Default: the algorithm in the class docstring.
        Must: send each call's ``id`` and ``name`` in its first delta.

        .. versionadded:: 1.1
        """
        self._text += delta_text
        return self._advance(final=False)

    def finish_streaming(self) -> StreamDelta | None:
        """Return what is left to send at the end of the output, or ``None``.

        Called: in the front end, once per streamed choice, after its last
        :meth:`extract_tool_calls_streaming` (also when generation stopped early, e.g. at
        ``max_tokens``).
        Default: the calls not yet sent, held-back text, and the content that
        ``extract_tool_calls`` reports in the tool text.

        .. versionadded:: 1.1
        """
        return self._advance(final=True)

    def _starts_tool_call(self, text: str) -> int | None:
        """Where tool text starts in ``text`` (the output so far), or ``None`` if not yet.

        Called: by the default streaming, after each delta (and at the end) until it
        returns an index.
        Default: the first ``tool_call_start`` in ``text``; with no marker, the first
        non-whitespace character.
        Must: once it returns an index for a text, return the same index for every longer
        text starting with it; the index must not fall in text already sent as content,
        i.e. before a trailing part that could begin ``tool_call_start``.

        .. versionadded:: 1.1
        """
        if self.tool_call_start is None:
            stripped = text.lstrip()
            return len(text) - len(stripped) if stripped else None
        index = text.find(self.tool_call_start)
        return index if index >= 0 else None

    def _advance(self, final: bool) -> StreamDelta | None:
        content = ""
        if self._tool_start is None:
            start = self._starts_tool_call(self._text)
            if start is None:
                end = len(self._text) if final else len(self._text) - self._num_held_back()
            else:
                # Text already sent cannot be taken back: a start inside it (a hook that
                # breaks its rule) counts from the first unsent character.
                end = self._tool_start = max(start, self._num_content_chars)
            content = self._text[self._num_content_chars:end]
            self._num_content_chars = max(end, self._num_content_chars)
        calls: tuple[ToolCallDelta, ...] = ()
        if self._tool_start is not None:
            found = self.extract_tool_calls(self._text[self._tool_start:])
            new = found.tool_calls[self._num_sent_calls:]
            calls = tuple(ToolCallDelta(index=i, id=self._call_id(i, call), name=call.name,
                                        arguments=call.arguments)
                          for i, call in enumerate(new, start=self._num_sent_calls))
            self._num_sent_calls += len(new)
            if final and found.content is not None:
                content += found.content
        if not (content or calls):
            return None
        return StreamDelta(content=content or None, tool_calls=calls)

    def _num_held_back(self) -> int:
        """Length of the longest end of the text so far that could begin the marker."""
        marker = self.tool_call_start
        if not marker:
            return 0
        for size in range(min(len(marker) - 1, len(self._text)), 0, -1):
            if self._text.endswith(marker[:size]):
                return size
        return 0

    def _call_id(self, index: int, call: ToolCall) -> str:
        """The id of call ``index``: the parser's, else one made once per instance."""
        if call.id is not None:
            return call.id
        if index not in self._call_ids:
            self._call_ids[index] = f"call_{uuid4().hex[:24]}"
        return self._call_ids[index]
