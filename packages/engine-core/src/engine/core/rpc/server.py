"""The gRPC side of the EngineCore process: the ``EngineCore`` service and its server.

The servicer never touches the scheduler itself: it hands work to the
:class:`~engine.core.engine.loop.EngineLoop` (which runs on the main thread) and streams the
loop's per-step outputs back. Over TCP,
:class:`~engine.core.rpc.server_auth.SecretInterceptor` checks the per-launch secret on
every call before any handler runs.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from engine.core.engine.loop import EngineLoop, LoopStoppedError
from engine.core.messages import CollectiveRpcError, EngineInfo
from engine.core.rpc import convert
from engine.core.rpc._gen import engine_core_pb2 as pb
from engine.core.rpc._gen import engine_core_pb2_grpc as pb_grpc
from engine.core.rpc.channel import (
    CALL_TIMEOUT_S,
    SERVER_OPTIONS,
)
from engine.core.rpc.serving import start_grpc_server
from engine.core.rpc.stream_sink import END_OF_STREAM, StreamSink

logger = logging.getLogger("engine.core.rpc")

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
        subscriber = StreamSink()
        try:
            self._loop.attach(subscriber)
        except LoopStoppedError:
            self._stream_lock.release()
            context.abort(grpc.StatusCode.UNAVAILABLE, "EngineCore is stopping")

        def on_end() -> None:
            subscriber.end()
            self._loop.detach(subscriber)
        context.add_callback(on_end)
        reader = threading.Thread(target=self._read, args=(request_iterator, subscriber),
                                  name="engine-core-stream-reader", daemon=True)
        reader.start()
        try:
            while True:
                item = subscriber.queue.get()
                if item is END_OF_STREAM:
                    break
                yield item
        finally:
            self._stream_lock.release()

    def _read(self, request_iterator: Iterator[pb.ClientMessage],
              subscriber: StreamSink) -> None:
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

    def _add(self, subscriber: StreamSink, message: pb.AddRequests) -> None:
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

    def CollectiveRpc(self, request: pb.CollectiveRpcCall,
                      context: grpc.ServicerContext) -> pb.CollectiveRpcResults:
        """``collective_rpc`` on the loop thread, between two steps; failures are answers."""
        timeout = request.timeout_s if request.HasField("timeout_s") else None
        try:
            args = json.loads(request.args_json or "[]")
            kwargs = json.loads(request.kwargs_json or "{}")
        except json.JSONDecodeError as exc:
            return pb.CollectiveRpcResults(error=pb.CollectiveRpcFailure(
                message=f"collective_rpc {request.method!r}: arguments are not JSON: {exc}"))
        future = self._loop.call_future(lambda: self._loop.core.collective_rpc(
            request.method, args, kwargs, timeout))
        try:
            results = future.result(None if timeout is None else timeout + CALL_TIMEOUT_S)
            return pb.CollectiveRpcResults(results_json=json.dumps(results))
        except CollectiveRpcError as exc:
            failure = pb.CollectiveRpcFailure(message=str(exc))
            if exc.rank is not None:
                failure.rank = exc.rank
            return pb.CollectiveRpcResults(error=failure)
        except (TypeError, ValueError) as exc:
            return pb.CollectiveRpcResults(error=pb.CollectiveRpcFailure(
                message=f"collective_rpc {request.method!r}: the results are not "
                        f"JSON-serialisable: {exc}"))
        except (LoopStoppedError, TimeoutError) as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"EngineCore is not serving: {exc}")
            raise  # unreachable: abort raises

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
    """Build and start the EngineCore server on ``address`` (``unix:PATH`` or ``HOST:PORT``).

    Handlers run on ``executor`` (the caller shuts it down after ``server.stop()``). Raises
    as :func:`~engine.core.rpc.serving.start_grpc_server` does.
    """
    return start_grpc_server(
        lambda server: pb_grpc.add_EngineCoreServicer_to_server(  # type: ignore[no-untyped-call]
            EngineCoreServicer(loop, info), server),
        address, secret=secret, executor=executor, options=SERVER_OPTIONS, who="EngineCore",
        refusal="this EngineCore only serves the front end that launched it")
