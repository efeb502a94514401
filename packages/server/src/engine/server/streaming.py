"""Server-sent events, deltas of cumulative outputs, and client disconnects.

* :class:`ChunkFrames` serialises a stream's chunks around their one choice.
* :class:`SSEResponse` sends ``data: {json}`` frames, each followed by a blank line. It
  watches for the client disconnecting while it streams and then stops the body
  iterator, whose ``finally`` aborts the requests (their KV blocks are freed at once,
  not when the next token would fail to send).
* :func:`cancel_on_disconnect` does the same for non-streaming responses.
* :class:`ChoiceCursor` turns a choice's cumulative output into the pieces not sent yet.
* :func:`merge_streams` interleaves several requests' outputs (one per prompt).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.core.client.async_llm import AsyncLLM
from engine.core.client.request_stream import RequestStream
from engine.core.frontend.input_processor import PromptType
from engine.core.outputs import CompletionOutput, LogprobsStep, RequestOutput
from engine.sdk.errors import ValidationError
from engine.sdk.sampling_params import SamplingParams
from engine.server.errors import error_body, to_api_error
from engine.server.sampling import renamed

T = TypeVar("T")

DONE_FRAME = "data: [DONE]\n\n"


def sse_frame(payload: Any) -> str:
    """One SSE frame holding ``payload`` (a pydantic model or JSON-able object)."""
    if hasattr(payload, "model_dump_json"):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


class ChunkFrames:
    """SSE frames of one streamed response's chunks, each holding one choice.

    Every chunk of a stream has the same envelope (id, created, model, ...) around its
    ``choices``; the envelope is serialised once, each frame then serialises only its
    choice (per token 2.8 us where building and dumping the whole chunk took 4.7).

    Args:
        envelope: A chunk of the stream with no choices (``choices=[]``).
    """

    def __init__(self, envelope: BaseModel) -> None:
        whole = sse_frame(envelope)
        marker = '"choices":[]'
        if whole.count(marker) != 1:
            raise ValueError("the envelope must hold exactly one empty choices list: "
                             f"{envelope.model_dump_json()}")
        cut = whole.index(marker) + len(marker) - 1
        self._head, self._tail = whole[:cut], whole[cut:]

    def frame(self, choice: BaseModel) -> str:
        """The frame of the chunk holding ``choice`` alone."""
        return self._head + choice.model_dump_json() + self._tail


def error_frame(exc: BaseException) -> str:
    """The frame that reports an error in the middle of a stream."""
    error = to_api_error(exc)
    return sse_frame(error_body(error.status, error.message, param=error.param,
                                code=error.code))


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class SSEResponse(StreamingResponse):
    """A ``text/event-stream`` response that stops its iterator when the client goes."""

    def __init__(self, body: AsyncIterator[str], *,
                 on_close: Callable[[], None] | None = None) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def _stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        async for frame in self.body_iterator:
            data = frame.encode() if isinstance(frame, str) else bytes(frame)
            await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self._stream(send))
        watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({stream, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, watcher):
                task.cancel()
            for task in (stream, watcher):
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await task
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
            if self._on_close is not None:
                self._on_close()


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; cancel it if the client disconnects first.

    Raises:
        ClientDisconnected: the client went away (``work`` was cancelled).
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


@dataclass
class ChoiceDelta:
    """What a choice gained since it was last sent."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[LogprobsStep] | None
    finish_reason: str | None
    stop_reason: int | str | None


class ChoiceCursor:
    """How much of one choice was sent; :meth:`advance` returns the rest, or None."""

    def __init__(self) -> None:
        self.num_chars = 0
        self.num_tokens = 0
        self.finished = False

    def advance(self, choice: CompletionOutput) -> ChoiceDelta | None:
        """The unsent part of ``choice`` (None when nothing changed or it already ended)."""
        if self.finished:
            return None
        text = choice.text[self.num_chars:]
        token_ids = choice.token_ids[self.num_tokens:]
        logprobs = None if choice.logprobs is None else choice.logprobs[self.num_tokens:]
        if not text and not token_ids and choice.finish_reason is None:
            return None
        self.num_chars = len(choice.text)
        self.num_tokens = len(choice.token_ids)
        self.finished = choice.finish_reason is not None
        return ChoiceDelta(choice.index, text, token_ids, logprobs, choice.finish_reason,
                           choice.stop_reason)


async def merge_streams(streams: Sequence[RequestStream]) -> AsyncIterator[
        tuple[int, RequestOutput]]:
    """Yield ``(stream index, output)`` as any stream changes, until all finished.

    Closing the iterator (or an error in one stream) closes every stream, which aborts the
    requests still running.
    """
    if len(streams) == 1:
        try:
            async for output in streams[0]:
                yield 0, output
        finally:
            streams[0].close()
        return
    changes: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = (
        asyncio.Queue())

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                changes.put_nowait((index, output, None))
            changes.put_nowait((index, None, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            changes.put_nowait((index, None, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, change, error = await changes.get()
            if error is not None:
                raise error
            if change is None:
                remaining -= 1
            else:
                yield index, change
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()


async def start_requests(engine: AsyncLLM, request_id: str, prompts: Sequence[PromptType],
                         params: SamplingParams, *, priority: int = 0,
                         rename: Mapping[str, str] | None = None) -> list[RequestStream]:
    """Queue one engine request per prompt (ids ``{request_id}-{i}``); all or none.

    Each prompt is tokenized on the engine's tokenizer pool (off the event loop).

    Raises:
        ValidationError: a prompt is invalid (the ones already queued are aborted).
        EngineDeadError: the engine is gone.
    """
    streams: list[RequestStream] = []
    try:
        for index, prompt in enumerate(prompts):
            streams.append(await engine.add_request_async(f"{request_id}-{index}", prompt,
                                                          params, priority=priority))
    except ValidationError as exc:
        for stream in streams:
            stream.close()
        raise renamed(exc, rename) from None
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    return streams


def close_all(streams: Sequence[RequestStream]) -> None:
    """Close every stream (requests still running are aborted)."""
    for stream in streams:
        stream.close()


async def collect_final(streams: Sequence[RequestStream]) -> list[RequestOutput]:
    """Wait until every stream finished; returns their final outputs, in order."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for index, output in merge_streams(streams):
        finals[index] = output
    return [output if output is not None else stream.output
            for output, stream in zip(finals, streams, strict=True)]
