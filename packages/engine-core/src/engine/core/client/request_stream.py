"""``RequestStream``: one request's outputs, as the front end's output handler produces them.

The ``RequestOutput`` is cumulative and updated in place, so the stream only has to say
*that* it changed: each ``__anext__`` waits for a change and returns the same live object.
Several steps that land before the consumer looks are seen as one change (a slow client
never makes a queue grow); consumers that send deltas keep their own offsets.

A request that a plugin failed (a sequence finished with ``"error"``) ends its stream with
that ``PluginError`` (the server answers it with HTTP 500 ``plugin_error``); the output
keeps what was generated before, with ``CompletionOutput.error`` set.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from engine.core.outputs import RequestOutput


class RequestStream:
    """Async iterator over one request's output; see the module docstring.

    Args:
        output: The request's live output object.
        on_close: Called with the request id when the stream is closed before the request
            finished (the engine aborts it).
    """

    def __init__(self, output: RequestOutput, *, on_close: Callable[[str], None]) -> None:
        self.output = output
        self._on_close = on_close
        self._changed = asyncio.Event()
        self._error: BaseException | None = None
        self._done = False

    @property
    def request_id(self) -> str:
        """The request's id."""
        return self.output.request_id

    def notify(self) -> None:
        """The output changed (called by the output handler)."""
        self._changed.set()

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error`` unless the request already finished."""
        if not self.output.finished:
            self._error = error
        self._changed.set()

    def close(self) -> None:
        """Stop listening; an unfinished request is aborted. Idempotent."""
        if not self._done:
            self._done = True
            if not self.output.finished and self._error is None:
                self._on_close(self.request_id)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        await self._changed.wait()
        self._changed.clear()
        if self._error is not None:
            self._done = True
            raise self._error
        if self.output.finished:
            self._done = True
            failure = self.output.error
            if failure is not None:  # a plugin failed while serving it: HTTP 500 plugin_error
                raise failure.to_error()
        return self.output
