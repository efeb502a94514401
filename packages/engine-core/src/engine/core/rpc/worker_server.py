"""The gRPC side of a worker process: the ``Worker`` service of ``worker.proto``.

The servicer drives any object that implements :class:`WorkerProtocol` (the engine's
``Worker``, or a test double). The worker is not thread-safe, so every call into it runs
under one lock, one at a time, whatever the server's thread pool; ``Shutdown`` only sets
:attr:`WorkerServicer.shutdown_event`, which the process main waits on before it stops the
server and exits. An exception in the worker becomes a ``WorkerError`` in the response
(the caller raises it as :class:`~engine.core.rpc.worker_convert.WorkerCallError`); gRPC
status errors are left to mean "the call did not reach a working worker".

Over TCP, :class:`~engine.core.rpc.server.SecretInterceptor` checks the per-launch secret
on every call before any handler runs.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import grpc

from engine.core.rpc._gen import engine_core_pb2 as core_pb
from engine.core.rpc._gen import worker_pb2 as pb
from engine.core.rpc._gen import worker_pb2_grpc as pb_grpc
from engine.core.rpc.channel import SERVER_OPTIONS
from engine.core.rpc.serving import start_grpc_server
from engine.core.rpc.worker_convert import (
    runner_output_to_proto,
    scheduler_output_from_proto,
    worker_error_to_proto,
)
from engine.sdk.scheduler import ModelRunnerOutput, SchedulerOutput

__all__ = ["WorkerProtocol", "WorkerServicer", "make_worker_server", "WORKER_MAX_MESSAGE_BYTES",
           "WORKER_CHANNEL_OPTIONS", "WORKER_SERVER_OPTIONS"]

logger = logging.getLogger("engine.core.rpc")

#: The worker channel is private to one launch: allow the largest message gRPC can carry
#: (a long prompt's prompt logprobs can exceed EngineCore's own cap).
WORKER_MAX_MESSAGE_BYTES = 2**31 - 1
_SIZE_OPTIONS = ("grpc.max_send_message_length", "grpc.max_receive_message_length")
#: For both ends of the worker channel (the client adds keepalive over TCP).
WORKER_CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    (name, WORKER_MAX_MESSAGE_BYTES) for name in _SIZE_OPTIONS]
WORKER_SERVER_OPTIONS: list[tuple[str, Any]] = [
    *WORKER_CHANNEL_OPTIONS, *(item for item in SERVER_OPTIONS if item[0] not in _SIZE_OPTIONS)]

_T = TypeVar("_T")


class WorkerProtocol(Protocol):
    """What :class:`WorkerServicer` calls: the worker of one tensor-parallel rank.

    Called: one method at a time (the servicer holds a lock), on the server's threads.
    """

    @property
    def rank(self) -> int:
        """This worker's tensor-parallel rank (a plain attribute will do)."""

    @property
    def num_available_blocks(self) -> int:
        """KV blocks that fit in the memory left after the model loaded."""

    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache with ``num_blocks`` blocks."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one engine step."""

    def collective_rpc(self, method: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        """Call ``method`` of the worker (or a worker extension); the result must be JSON."""

    def check_health(self) -> None:
        """Raise if the worker cannot serve."""


class WorkerServicer(pb_grpc.WorkerServicer):
    """``engine.v1.Worker`` over a :class:`WorkerProtocol` object.

    Args:
        worker: The worker to drive.
        shutdown_event: Set by ``Shutdown`` (a new event when None); see
            :attr:`shutdown_event`.
    """

    def __init__(self, worker: WorkerProtocol,
                 shutdown_event: threading.Event | None = None) -> None:
        self._worker = worker
        self._lock = threading.Lock()
        self._shutdown_event = threading.Event() if shutdown_event is None else shutdown_event

    @property
    def shutdown_event(self) -> threading.Event:
        """Set once ``Shutdown`` was called: the process main waits on it, then exits."""
        return self._shutdown_event

    def _call(self, fn: Callable[[], _T]) -> _T:
        with self._lock:
            return fn()

    def GetInfo(self, request: pb.WorkerInfoRequest,
                context: grpc.ServicerContext) -> pb.WorkerInfo:
        """The rank and the KV blocks that fit on it."""
        worker = self._worker
        rank, blocks = self._call(lambda: (worker.rank, worker.num_available_blocks))
        return pb.WorkerInfo(rank=rank, num_available_blocks=blocks)

    def InitializeCache(self, request: pb.InitializeCacheRequest,
                        context: grpc.ServicerContext) -> pb.InitializeCacheResponse:
        """``initialize_cache``; a failure travels as ``error``."""
        try:
            self._call(lambda: self._worker.initialize_cache(request.num_blocks))
        except Exception as exc:  # noqa: BLE001 - the caller gets it as a WorkerError
            return pb.InitializeCacheResponse(error=self._error(exc, "initialize_cache"))
        return pb.InitializeCacheResponse()

    def ExecuteModel(self, request: pb.SchedulerOutput,
                     context: grpc.ServicerContext) -> pb.ExecuteModelResponse:
        """One step; the output, or the worker's exception as ``error``."""
        response = pb.ExecuteModelResponse()
        try:
            scheduler_output = scheduler_output_from_proto(request)
            output = self._call(lambda: self._worker.execute_model(scheduler_output))
            runner_output_to_proto(output, response.output)
        except Exception as exc:  # noqa: BLE001 - the caller gets it as a WorkerError
            response.error.CopyFrom(self._error(exc, "execute_model"))
        return response

    def CollectiveRpc(self, request: pb.CollectiveRpcRequest,
                      context: grpc.ServicerContext) -> pb.CollectiveRpcResponse:
        """``collective_rpc(method, *args, **kwargs)`` with JSON in and out."""
        try:
            args = json.loads(request.args_json) if request.args_json else []
            kwargs = json.loads(request.kwargs_json) if request.kwargs_json else {}
            if not isinstance(args, list) or not isinstance(kwargs, dict):
                raise TypeError("collective_rpc needs a JSON array of arguments and a JSON "
                                "object of keyword arguments")
            result = self._call(lambda: self._worker.collective_rpc(request.method, args,
                                                                    kwargs))
            try:
                result_json = json.dumps(result, separators=(",", ":"))
            except (TypeError, ValueError) as exc:
                raise TypeError(f"collective_rpc {request.method!r} returned a value that is "
                                f"not JSON-serialisable: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - the caller gets it as a WorkerError
            return pb.CollectiveRpcResponse(
                error=self._error(exc, f"collective_rpc {request.method!r}"))
        return pb.CollectiveRpcResponse(result_json=result_json)

    def Health(self, request: core_pb.HealthRequest,
               context: grpc.ServicerContext) -> pb.WorkerHealthResponse:
        """``check_health`` (after any call in progress); unhealthy with the reason."""
        try:
            self._call(self._worker.check_health)
        except Exception as exc:  # noqa: BLE001 - unhealthy, with the reason
            return pb.WorkerHealthResponse(healthy=False,
                                           error=self._error(exc, "check_health"))
        return pb.WorkerHealthResponse(healthy=True)

    def Shutdown(self, request: core_pb.ShutdownRequest,
                 context: grpc.ServicerContext) -> core_pb.ShutdownResponse:
        """Set :attr:`shutdown_event`; the process exits once the response is sent."""
        logger.info("worker rank %s: shutdown requested", self._worker.rank)
        self._shutdown_event.set()
        return core_pb.ShutdownResponse()

    def _error(self, exc: Exception, what: str) -> pb.WorkerError:
        rank = self._worker.rank
        logger.warning("worker rank %s: %s failed: %s: %s", rank, what,
                       type(exc).__name__, exc)
        return worker_error_to_proto(exc, rank)


def make_worker_server(worker: WorkerProtocol, address: str, *, secret: str | None = None,
                       executor: ThreadPoolExecutor,
                       shutdown_event: threading.Event | None = None
                       ) -> tuple[grpc.Server, str]:
    """Build and start the worker's gRPC server on ``address`` (``unix:PATH`` or ``HOST:PORT``).

    Handlers run on ``executor`` (the caller shuts it down after ``server.stop()``); give it
    two threads or more, so ``Shutdown`` and ``Health`` are answered while a step runs.

    Args:
        worker: The worker to serve.
        address: Where to listen; ``HOST:0`` picks a free port.
        secret: The per-launch secret every call must carry (required over TCP).
        executor: The thread pool the handlers run on.
        shutdown_event: Set when ``Shutdown`` is called; the process main waits on it.

    Returns:
        The started server and the address it listens on (the real port for ``:0``).

    Raises:
        ValueError: a TCP address without a secret.
        RuntimeError: the address could not be bound.
    """
    return start_grpc_server(
        lambda server: pb_grpc.add_WorkerServicer_to_server(  # type: ignore[no-untyped-call]
            WorkerServicer(worker, shutdown_event), server),
        address, secret=secret, executor=executor, options=WORKER_SERVER_OPTIONS,
        who=f"worker rank {worker.rank}",
        refusal="this worker only serves the EngineCore that launched it")
