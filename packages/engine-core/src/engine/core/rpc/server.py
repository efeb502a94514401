"""The gRPC side of the EngineCore process: the ``EngineCore`` service and its server.

The servicer never touches the scheduler itself: it hands work to the
:class:`~engine.core.rpc.loop.EngineLoop` (which runs on the main thread) and streams the
loop's per-step outputs back. Over TCP, :class:`SecretInterceptor` checks the per-launch
secret on every call before any handler runs.
"""

from __future__ import annotations

import hmac
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from engine.core.client.core_client import EngineInfo
from engine.core.rpc import convert
from engine.core.rpc._gen import engine_core_pb2 as pb
from engine.core.rpc._gen import engine_core_pb2_grpc as pb_grpc
from engine.core.rpc.loop import END_OF_STREAM, EngineLoop, LoopStoppedError, Subscriber

logger = logging.getLogger("engine.core.rpc")

#: Call metadata key carrying the per-launch secret (TCP only).
SECRET_METADATA_KEY = "x-engine-secret"
#: Messages may be large (a batch of long prompts); gRPC's default cap is 4 MiB.
MAX_MESSAGE_BYTES = 512 * 1024 * 1024
#: Seconds a unary call waits for the loop to run it (it runs between two steps).
CALL_TIMEOUT_S = 60.0

CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
#: The server accepts the client's 1 s keepalive pings (TCP death detection).
SERVER_OPTIONS: list[tuple[str, Any]] = [
    *CHANNEL_OPTIONS,
    ("grpc.http2.min_ping_interval_without_data_ms", 500),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.so_reuseport", 0),
]


def _deny(request: Any, context: grpc.ServicerContext) -> Any:
    context.abort(grpc.StatusCode.UNAUTHENTICATED,
                  f"missing or wrong {SECRET_METADATA_KEY} metadata: this EngineCore only "
                  f"serves the front end that launched it")


class SecretInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    """Refuses every call whose ``x-engine-secret`` metadata is not the launch secret."""

    def __init__(self, secret: str) -> None:
        self._secret = secret.encode()

    def intercept_service(self, continuation: Callable[[Any], Any],
                          handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        given = next((value for key, value in handler_call_details.invocation_metadata or ()
                      if key == SECRET_METADATA_KEY), "")
        if handler is None or hmac.compare_digest(str(given).encode(), self._secret):
            return handler
        # Answer with a handler of the same shape, so a stream is refused at once.
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(_deny)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(_deny)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(_deny)
        return grpc.unary_unary_rpc_method_handler(_deny)


class EngineCoreServicer(pb_grpc.EngineCoreServicer):
    """``engine.v1.EngineCore`` over an :class:`EngineLoop`.

    Args:
        loop: The busy loop that owns EngineCore.
        info: What ``GetInfo`` answers.
    """

    def __init__(self, loop: EngineLoop, info: EngineInfo) -> None:
        self._loop = loop
        self._info = convert.info_to_proto(info)
        self._stream_lock = threading.Lock()

    def Stream(self, request_iterator: Iterator[pb.ClientMessage],
               context: grpc.ServicerContext) -> Iterator[pb.ServerMessage]:
        """Requests in, one ``ServerMessage`` per engine step out."""
        if not self._stream_lock.acquire(blocking=False):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          "another front end is already connected to this EngineCore")
        subscriber = Subscriber()
        try:
            self._loop.attach(subscriber)
        except LoopStoppedError:
            self._stream_lock.release()
            context.abort(grpc.StatusCode.UNAVAILABLE, "EngineCore is stopping")
        context.add_callback(lambda: self._loop.detach(subscriber))
        reader = threading.Thread(target=self._read, args=(request_iterator, subscriber),
                                  name="engine-core-stream-reader", daemon=True)
        reader.start()
        try:
            while True:
                item = subscriber.queue.get()
                if item is END_OF_STREAM:
                    break
                yield item
            if self._loop.error is not None:
                yield pb.ServerMessage(error=pb.EngineError(message=self._loop.error))
        finally:
            self._stream_lock.release()

    def _read(self, request_iterator: Iterator[pb.ClientMessage],
              subscriber: Subscriber) -> None:
        """Turn client messages into loop work (a thread per stream)."""
        loop = self._loop
        try:
            for message in request_iterator:
                kind = message.WhichOneof("kind")
                if kind == "add":
                    self._add(subscriber, message.add)
                elif kind == "abort":
                    loop.abort_requests(subscriber, list(message.abort.request_ids))
                elif kind == "finish":
                    loop.finish_requests(
                        subscriber, list(message.finish.request_ids),
                        convert.request_status_from_proto(message.finish.status))
        except LoopStoppedError:
            pass
        except grpc.RpcError:
            pass  # the stream ended (client gone); detach runs from the context callback
        except Exception:
            logger.exception("malformed message on the EngineCore stream")

    def _add(self, subscriber: Subscriber, message: pb.AddRequests) -> None:
        requests = []
        for item in message.requests:
            try:
                requests.append(convert.request_from_proto(item))
            except Exception as exc:  # noqa: BLE001 - a bad request is refused; others go on
                self._loop.reject([item.request_id], f"{type(exc).__name__}: {exc}")
        if requests:
            self._loop.add_requests(subscriber, requests)

    def Health(self, request: pb.HealthRequest,
               context: grpc.ServicerContext) -> pb.HealthResponse:
        """Alive while the loop runs and has not failed."""
        return pb.HealthResponse(healthy=self._loop.is_running and self._loop.error is None)

    def GetInfo(self, request: pb.GetInfoRequest,
                context: grpc.ServicerContext) -> pb.EngineInfo:
        """The engine's static facts."""
        return self._info

    def GetStats(self, request: pb.GetStatsRequest,
                 context: grpc.ServicerContext) -> pb.SchedulerStats:
        """``make_stats`` on the loop thread."""
        stats = self._on_loop(self._loop.core.make_stats, context)
        return convert.stats_to_proto(stats)

    def ResetPrefixCache(self, request: pb.ResetPrefixCacheRequest,
                         context: grpc.ServicerContext) -> pb.ResetPrefixCacheResponse:
        """``reset_prefix_cache`` on the loop thread."""
        return pb.ResetPrefixCacheResponse(
            ok=self._on_loop(self._loop.core.reset_prefix_cache, context))

    def Shutdown(self, request: pb.ShutdownRequest,
                 context: grpc.ServicerContext) -> pb.ShutdownResponse:
        """Stop the loop; the process exits once the response is sent."""
        logger.info("EngineCore: shutdown requested")
        self._loop.stop()
        return pb.ShutdownResponse()

    def _on_loop(self, fn: Callable[[], Any], context: grpc.ServicerContext) -> Any:
        try:
            return self._loop.call(fn, timeout=CALL_TIMEOUT_S)
        except (LoopStoppedError, TimeoutError) as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"EngineCore is not serving: {exc}")


def make_server(loop: EngineLoop, info: EngineInfo, address: str, *, secret: str | None,
                executor: ThreadPoolExecutor) -> tuple[grpc.Server, str]:
    """Build and start the gRPC server on ``address`` (``unix:PATH`` or ``HOST:PORT``).

    Handlers run on ``executor`` (the caller shuts it down after ``server.stop()``).

    Returns:
        The started server and the address it listens on (the real port for ``:0``).

    Raises:
        ValueError: a TCP address without a secret.
        RuntimeError: the address could not be bound.
    """
    is_unix = address.startswith("unix:")
    if not is_unix and not secret:
        raise ValueError("EngineCore over TCP needs a per-launch secret")
    server = grpc.server(
        executor, interceptors=[SecretInterceptor(secret)] if secret else [],
        options=SERVER_OPTIONS,
    )
    pb_grpc.add_EngineCoreServicer_to_server(  # type: ignore[no-untyped-call]
        EngineCoreServicer(loop, info), server)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise RuntimeError(f"EngineCore could not listen on {address}: {exc}") from exc
    if not is_unix and port == 0:
        raise RuntimeError(f"EngineCore could not listen on {address}")
    server.start()
    bound = address if is_unix else f"{address.rsplit(':', 1)[0]}:{port}"
    return server, bound
