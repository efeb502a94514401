"""The per-launch secret check every private gRPC server runs over TCP.

The check runs on the call's metadata, which arrives before its message. A call that fails
it is answered by a handler that takes the request as a stream and never reads it, so an
unauthenticated peer cannot make the server hold its message (up to the 512 MiB cap of
``channel.MAX_MESSAGE_BYTES``): a unary handler would read and buffer the whole message
before it could refuse. What the peer sent stays in the transport, bounded by HTTP/2 flow
control (a stream's window), and is dropped when the call ends.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from engine.core.rpc.channel import SECRET_METADATA_KEY


class SecretInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    """Refuses every call whose ``x-engine-secret`` metadata is not the launch secret.

    Args:
        secret: The per-launch secret.
        refusal: How the refusal describes this server and whom it serves.
    """

    def __init__(self, secret: str, *, refusal: str = "this EngineCore only serves the "
                 "front end that launched it") -> None:
        self._secret = secret.encode()
        message = f"missing or wrong {SECRET_METADATA_KEY} metadata: {refusal}"

        def deny(request_iterator: Iterator[Any], context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)  # reads no message
        # Request-streaming whatever the method's shape (on the wire a unary request is a
        # stream of one message): the handler is called before any message is read.
        self._deny_unary_response = grpc.stream_unary_rpc_method_handler(deny)
        self._deny_stream_response = grpc.stream_stream_rpc_method_handler(deny)

    def intercept_service(self, continuation: Callable[[Any], Any],
                          handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        given = next((value for key, value in handler_call_details.invocation_metadata or ()
                      if key == SECRET_METADATA_KEY), "")
        if handler is None or hmac.compare_digest(str(given).encode(), self._secret):
            return handler
        if handler.response_streaming:
            return self._deny_stream_response
        return self._deny_unary_response
