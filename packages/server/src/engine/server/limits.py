"""``--max-request-bytes``: a request body larger than the limit is a 413, never parsed.

:class:`RequestSizeLimitMiddleware` checks ``Content-Length`` before the app sees the
request, and counts the bytes of a body as they arrive (chunked uploads, or a client whose
``Content-Length`` is missing): once the limit is passed it answers 413 itself and stops the
app reading, so no route, endpoint plugin or JSON parser ever holds more than the limit.

The default, 32 MiB, is vLLM's Rust front end's (and Anthropic's API's) body cap. It lets
the longest legitimate prompt of a long-context model through: a 1M-token prompt is about
4 MB of English text, 8 MB as token ids, about 10 MB of JSON-escaped non-Latin text.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

#: ``--max-request-bytes`` by default: 32 MiB.
DEFAULT_MAX_REQUEST_BYTES = 32 * 1024 * 1024


def check_max_request_bytes(max_bytes: int) -> None:
    """Raises ValueError unless ``max_bytes`` is a usable limit (at least 1)."""
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(f"--max-request-bytes must be a whole number of bytes, at least 1 "
                         f"(default {DEFAULT_MAX_REQUEST_BYTES}), got {max_bytes!r}")


class RequestTooLarge(Exception):
    """Raised to the app from ``receive`` once the body passed the limit (413 already sent)."""


def describe_size(num_bytes: int) -> str:
    """``"33554432 bytes (32.0 MiB)"``."""
    return f"{num_bytes} bytes ({num_bytes / 2**20:.1f} MiB)"


def too_large_message(limit: int, size: int | None) -> str:
    """The 413 message: how big the body is (if known) and what the limit is."""
    what = (f"the request body is {describe_size(size)}" if size is not None
            else "the request body is larger than the limit")
    return (f"{what}; this server accepts at most {describe_size(limit)} per request "
            f"(engine serve --max-request-bytes)")


class RequestSizeLimitMiddleware:
    """Answer 413 to an HTTP request whose body exceeds ``max_bytes`` (see the module doc)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        check_max_request_bytes(max_bytes)
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await _reject(scope, send, too_large_message(self.max_bytes, declared))
            return
        num_received = 0
        started = rejected = False

        async def counting_receive() -> Message:
            nonlocal num_received, rejected
            message = await receive()
            if message["type"] == "http.request":
                num_received += len(message.get("body", b""))
                if num_received > self.max_bytes and not rejected:
                    rejected = True
                    if not started:
                        await _reject(scope, send, too_large_message(self.max_bytes, None))
                    raise RequestTooLarge(too_large_message(self.max_bytes, None))
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if rejected:
                return  # the 413 went out; whatever the app answers to the error is dropped
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except RequestTooLarge:
            pass
        except Exception:
            if not rejected:
                raise
            # After the 413, any error is the app's reaction to RequestTooLarge (e.g. wrapped
            # in its own): the client has its answer, nothing is left to report.


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP server refuses a malformed length itself
    return None


async def _reject(scope: Scope, send: Send, message: str) -> None:
    from engine.server.errors import error_response  # fastapi: only when rejecting

    response = error_response(413, message, code="request_too_large")

    async def no_receive() -> Message:
        return {"type": "http.disconnect"}

    await response(scope, no_receive, send)
