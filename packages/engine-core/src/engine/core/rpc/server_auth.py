"""The per-launch secret check every private gRPC server runs over TCP."""

from __future__ import annotations

import hmac
from collections.abc import Callable
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

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        self._deny = deny

    def intercept_service(self, continuation: Callable[[Any], Any],
                          handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        given = next((value for key, value in handler_call_details.invocation_metadata or ()
                      if key == SECRET_METADATA_KEY), "")
        if handler is None or hmac.compare_digest(str(given).encode(), self._secret):
            return handler
        # Answer with a handler of the same shape, so a stream is refused at once.
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(self._deny)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(self._deny)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(self._deny)
        return grpc.unary_unary_rpc_method_handler(self._deny)
