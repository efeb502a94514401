"""EngineCore's side of ``worker.proto``: one :class:`WorkerClient` per worker process.

The per-step hot path encodes the step once and sends the same bytes to every rank::

    payload = encode_scheduler_output(scheduler_output)          # once per step
    futures = [client.execute_model_future(payload) for client in clients]
    outputs = [future.result() for future in futures]            # ModelRunnerOutput each

Failures come back as two distinct errors (both :class:`WorkerRpcError`):

* :class:`WorkerCallError`: the worker raised (its model, a plugin, a worker extension);
  it names the rank and, for a plugin, the plugin and its distribution;
* :class:`WorkerUnavailableError`: the call did not reach the worker (gRPC UNAVAILABLE):
  its process died or does not listen.

Any other gRPC status (a wrong secret, a deadline) is a plain :class:`WorkerRpcError`
carrying the status name. Every method is synchronous and may be called from any thread.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from engine.core.rpc._gen import engine_core_pb2 as core_pb
from engine.core.rpc._gen import worker_pb2 as pb
from engine.core.rpc._gen import worker_pb2_grpc as pb_grpc
from engine.core.rpc.channel import SECRET_METADATA_KEY, TCP_KEEPALIVE_OPTIONS
from engine.core.rpc.worker_convert import (
    WorkerCallError,
    WorkerRpcError,
    WorkerUnavailableError,
    runner_output_from_proto,
    scheduler_output_to_proto,
    worker_error_from_proto,
)
from engine.core.rpc.worker_server import WORKER_CHANNEL_OPTIONS
from engine.sdk.scheduler import ModelRunnerOutput, SchedulerOutput

__all__ = [
    "WorkerClient", "WorkerInfo", "ExecuteModelFuture", "encode_scheduler_output",
    "WorkerRpcError", "WorkerCallError", "WorkerUnavailableError",
]

EXECUTE_MODEL_METHOD = "/engine.v1.Worker/ExecuteModel"
#: Reconnect quickly: a worker starting up opens its socket while ``wait_ready`` polls.
RECONNECT_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 500),
]
#: Seconds a control call waits by default.
CALL_TIMEOUT_S = 60.0
#: The longest single GetInfo attempt inside :meth:`WorkerClient.wait_ready`.
READY_POLL_S = 0.25


def encode_scheduler_output(scheduler_output: SchedulerOutput) -> bytes:
    """The ``ExecuteModel`` request bytes: encode once per step, send to every rank."""
    payload: bytes = scheduler_output_to_proto(scheduler_output).SerializeToString()
    return payload


def _identity(payload: bytes) -> bytes:
    return payload


@dataclass(frozen=True)
class WorkerInfo:
    """What ``GetInfo`` answers once the worker has loaded its model.

    Attributes:
        rank: The worker's tensor-parallel rank.
        num_available_blocks: KV blocks that fit in the memory left after the model.
    """

    rank: int
    num_available_blocks: int


class ExecuteModelFuture:
    """One rank's ``ExecuteModel`` call in flight (wraps the gRPC future)."""

    def __init__(self, call: Any, client: WorkerClient) -> None:
        self._call = call
        self._client = client

    def done(self) -> bool:
        """True once the call finished (with a result or an error)."""
        return bool(self._call.done())

    def cancel(self) -> bool:
        """Cancel the call; True if it was still in flight."""
        return bool(self._call.cancel())

    def add_done_callback(self, fn: Callable[[ExecuteModelFuture], None]) -> None:
        """Call ``fn(self)`` once the call finished (at once if it already has)."""
        self._call.add_done_callback(lambda _: fn(self))

    def response(self, timeout: float | None = None) -> pb.ExecuteModelResponse:
        """The raw response, waiting up to ``timeout`` seconds.

        Raises:
            WorkerCallError: the worker raised.
            WorkerUnavailableError: the worker's process is gone.
            WorkerRpcError: another gRPC failure.
            TimeoutError: no answer within ``timeout``.
        """
        try:
            response: pb.ExecuteModelResponse = self._call.result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise TimeoutError(f"{self._client.describe()} did not finish the step within "
                               f"{timeout} s") from None
        except grpc.RpcError as exc:
            raise self._client.rpc_error(exc, "execute_model") from None
        if response.HasField("error"):
            raise worker_error_from_proto(response.error)
        return response

    def check(self, timeout: float | None = None) -> None:
        """Wait for the call and raise its error, without decoding the output."""
        self.response(timeout)

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        """The rank's ``ModelRunnerOutput`` (raises as :meth:`response` does)."""
        return runner_output_from_proto(self.response(timeout).output)


class WorkerClient:
    """A channel to one worker process.

    Args:
        address: ``unix:PATH`` or ``host:port``.
        secret: The per-launch secret (TCP); sent as ``x-engine-secret`` on every call.
        rank: The worker's rank, for error messages (learned from ``GetInfo`` otherwise).
    """

    def __init__(self, address: str, *, secret: str | None = None,
                 rank: int | None = None) -> None:
        self.address = address
        self.rank = rank
        options = [*WORKER_CHANNEL_OPTIONS, *RECONNECT_OPTIONS]
        if not address.startswith("unix:"):
            options += TCP_KEEPALIVE_OPTIONS
        self._channel = grpc.insecure_channel(address, options=options)
        self._stub = pb_grpc.WorkerStub(self._channel)  # type: ignore[no-untyped-call]
        # Takes the request as bytes already serialised: one encoding serves every rank.
        self._execute = self._channel.unary_unary(
            EXECUTE_MODEL_METHOD, request_serializer=_identity,
            response_deserializer=pb.ExecuteModelResponse.FromString)
        self._metadata = ((SECRET_METADATA_KEY, secret),) if secret else None

    def __enter__(self) -> WorkerClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- errors -------------------------------------------------------------------------

    def describe(self) -> str:
        """``worker rank N at ADDRESS`` (no rank until it is known)."""
        who = "worker" if self.rank is None else f"worker rank {self.rank}"
        return f"{who} at {self.address}"

    def rpc_error(self, exc: grpc.RpcError, what: str) -> WorkerRpcError:
        """The error to raise for a failed gRPC call ``what``."""
        code = exc.code() if isinstance(exc, grpc.Call) else None
        details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
        if code == grpc.StatusCode.UNAVAILABLE:
            return WorkerUnavailableError(
                f"{self.describe()} is unavailable ({what}): its process died or does not "
                f"listen: {details}", rank=self.rank, address=self.address)
        name = code.name if code is not None else "UNKNOWN"
        return WorkerRpcError(f"{self.describe()}: {what} failed with {name}: {details}",
                              rank=self.rank, code=name)

    def _unary(self, method: str, request: Any, timeout: float | None, what: str,
               *, wait_for_ready: bool = False) -> Any:
        try:
            return getattr(self._stub, method)(request, metadata=self._metadata,
                                               timeout=timeout, wait_for_ready=wait_for_ready)
        except grpc.RpcError as exc:
            raise self.rpc_error(exc, what) from None

    # --- start-up -----------------------------------------------------------------------

    def get_info(self, timeout: float | None = CALL_TIMEOUT_S, *,
                 wait_for_ready: bool = False) -> WorkerInfo:
        """The worker's rank and available KV blocks (records the rank).

        Args:
            timeout: Seconds to wait for the answer.
            wait_for_ready: Wait for the channel to connect instead of failing at once
                with :class:`WorkerUnavailableError` while the worker does not listen.
        """
        info = self._unary("GetInfo", pb.WorkerInfoRequest(), timeout, "get_info",
                           wait_for_ready=wait_for_ready)
        self.rank = info.rank
        return WorkerInfo(rank=info.rank, num_available_blocks=info.num_available_blocks)

    def wait_ready(self, timeout: float, *,
                   is_alive: Callable[[], bool] | None = None) -> WorkerInfo:
        """Poll ``GetInfo`` until the worker answers (it answers once its model is loaded).

        Args:
            timeout: Seconds to wait in all.
            is_alive: Checked between attempts (e.g. the process's ``is_alive``); waiting
                stops as soon as it returns False.

        Raises:
            WorkerUnavailableError: no answer within ``timeout``, or ``is_alive`` said no.
            WorkerRpcError: the worker answered with an error (e.g. a wrong secret).
        """
        deadline = time.monotonic() + timeout
        last = "no attempt made"
        while True:
            remaining = deadline - time.monotonic()
            if is_alive is not None and not is_alive():
                raise WorkerUnavailableError(
                    f"{self.describe()} exited before it was ready", rank=self.rank,
                    address=self.address)
            if remaining <= 0:
                raise WorkerUnavailableError(
                    f"{self.describe()} was not ready within {timeout} s ({last})",
                    rank=self.rank, address=self.address)
            try:
                return self.get_info(timeout=min(remaining, READY_POLL_S),
                                     wait_for_ready=True)
            except WorkerUnavailableError as exc:
                last = str(exc)
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
            except WorkerRpcError as exc:
                if exc.code != "DEADLINE_EXCEEDED":
                    raise
                last = str(exc)

    def initialize_cache(self, num_blocks: int, timeout: float | None = CALL_TIMEOUT_S
                         ) -> None:
        """Allocate the worker's KV cache (raises :class:`WorkerCallError` if it failed)."""
        response = self._unary("InitializeCache", pb.InitializeCacheRequest(
            num_blocks=num_blocks), timeout, "initialize_cache")
        if response.HasField("error"):
            raise worker_error_from_proto(response.error)

    # --- steps --------------------------------------------------------------------------

    def execute_model_future(self, payload: bytes, *, timeout: float | None = None
                             ) -> ExecuteModelFuture:
        """Send one step (the bytes of :func:`encode_scheduler_output`, sent unchanged)."""
        call = self._execute.future(payload, metadata=self._metadata, timeout=timeout)
        return ExecuteModelFuture(call, self)

    def collective_rpc(self, method: str, args: Sequence[Any] = (),
                       kwargs: dict[str, Any] | None = None,
                       timeout: float | None = CALL_TIMEOUT_S) -> Any:
        """Call ``method(*args, **kwargs)`` on the worker; JSON in, JSON out.

        Raises:
            TypeError: ``args`` or ``kwargs`` are not JSON-serialisable.
            WorkerCallError: the method raised (or returned something not JSON).
        """
        try:
            request = pb.CollectiveRpcRequest(
                method=method, args_json=json.dumps(list(args), separators=(",", ":")),
                kwargs_json=json.dumps(dict(kwargs or {}), separators=(",", ":")))
        except (TypeError, ValueError) as exc:
            raise TypeError(f"collective_rpc {method!r}: arguments travel as JSON: {exc}"
                            ) from exc
        response = self._unary("CollectiveRpc", request, timeout,
                               f"collective_rpc {method!r}")
        if response.HasField("error"):
            raise worker_error_from_proto(response.error)
        return json.loads(response.result_json)

    # --- control ------------------------------------------------------------------------

    def health(self, timeout: float | None = 5.0) -> None:
        """Return if the worker is healthy.

        Raises:
            WorkerCallError: the worker's health check failed (with its reason).
            WorkerUnavailableError: the worker's process is gone.
        """
        response = self._unary("Health", core_pb.HealthRequest(), timeout, "health")
        if response.HasField("error"):
            raise worker_error_from_proto(response.error)
        if not response.healthy:
            raise WorkerRpcError(f"{self.describe()} reports itself unhealthy",
                                 rank=self.rank)

    def shutdown(self, timeout: float | None = 5.0) -> bool:
        """Ask the worker process to exit; False if it was already unreachable."""
        try:
            self._unary("Shutdown", core_pb.ShutdownRequest(), timeout, "shutdown")
        except WorkerUnavailableError:
            return False
        return True

    def close(self) -> None:
        """Close the channel (calls in flight fail)."""
        self._channel.close()
