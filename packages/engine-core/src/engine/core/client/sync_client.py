"""``SyncCoreClient``: any :class:`EngineCoreClient`, driven from synchronous code.

``LLM`` is synchronous, the core clients are asyncio. This wrapper runs the client on an
event loop of its own (one daemon thread) and offers the methods ``LLMEngine`` calls on an
in-process :class:`~engine.core.engine_core.EngineCore`, so the offline API can use
EngineCore in its own process (``LLM(...)``, the default) or in this one
(``LLM(..., in_process=True)``) without another code path::

    core = SyncCoreClient(GrpcCoreClient.factory(setup, eos_token_id))
    core.add_request(request)
    outputs = core.step()          # the next engine step's outputs (blocks until it comes)
    core.shutdown()

Outputs arrive as EngineCore produces them (it steps on its own while requests are in
flight); :meth:`step` hands them over one engine step at a time, in order.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import threading
from collections.abc import Coroutine, Iterable, Sequence
from typing import Any, TypeVar

from engine.core.client.core_client import EngineCoreClient
from engine.core.messages import EngineDeadError, EngineInfo, StepOutputs
from engine.sdk.scheduler import EngineCoreOutput, EngineRequest, RequestStatus
from engine.sdk.stats import SchedulerStats

T = TypeVar("T")

#: How long :meth:`SyncCoreClient.step` waits for a step before returning nothing.
STEP_POLL_S = 1.0


class SyncCoreClient:
    """A core client on a private event-loop thread (see the module docstring).

    Args:
        client: The transport, not started yet; :meth:`__init__` starts it and returns once
            EngineCore can take requests.

    Raises:
        EngineDeadError: EngineCore failed to start (its error is in the message).
    """

    def __init__(self, client: EngineCoreClient) -> None:
        self.client = client
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever,
                                        name="engine-core-client", daemon=True)
        self._thread.start()
        self._steps: queue.SimpleQueue[StepOutputs | BaseException] = queue.SimpleQueue()
        self._closed = False
        try:
            self.info: EngineInfo = self._call(client.start())
        except BaseException:
            self._stop_loop()
            raise
        self._pump = asyncio.run_coroutine_threadsafe(self._pump_outputs(), self._loop)

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        if self._loop.is_closed():
            coroutine.close()
            raise self.client.dead_error or EngineDeadError("EngineCore was shut down")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def _on_loop(self, function: Any, *args: Any) -> None:
        """Run a non-blocking client method on the loop thread; its exception is re-raised."""
        async def call() -> None:
            function(*args)

        self._call(call())

    async def _pump_outputs(self) -> None:
        try:
            async for step in self.client.outputs():
                self._steps.put(step)
            self._steps.put(self.client.dead_error or EngineDeadError("EngineCore stopped"))
        except EngineDeadError as exc:
            self._steps.put(exc)
        except asyncio.CancelledError:  # shutdown() cancels the pump
            self._steps.put(EngineDeadError("EngineCore was shut down"))
            raise

    @property
    def dead_error(self) -> EngineDeadError | None:
        """Why EngineCore is gone, or None while it runs."""
        return self.client.dead_error

    # -- the methods LLMEngine calls (as on an in-process EngineCore) ----------------------

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request. Raises ``EngineDeadError`` if EngineCore is gone."""
        self.add_requests([request])

    def add_requests(self, requests: Sequence[EngineRequest]) -> None:
        """Queue requests in one message. Raises ``EngineDeadError`` if EngineCore is gone."""
        self._on_loop(self.client.add_requests, list(requests))

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """End requests now; their blocks are freed."""
        self._on_loop(self.client.abort_requests, list(request_ids))

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests with ``status`` (a stop string found by the front end)."""
        self._on_loop(self.client.finish_requests, list(request_ids), status)

    def step(self, timeout: float = STEP_POLL_S) -> list[EngineCoreOutput]:
        """The outputs of the next engine step; ``[]`` if none came within ``timeout`` s.

        Raises:
            EngineDeadError: EngineCore died or was shut down.
        """
        step = self.step_outputs(timeout)
        return [] if step is None else list(step.outputs)

    def step_outputs(self, timeout: float = STEP_POLL_S) -> StepOutputs | None:
        """The next engine step with its scheduler stats; ``None`` if none came in time.

        Raises:
            EngineDeadError: EngineCore died or was shut down.
        """
        try:
            item = self._steps.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            self._steps.put(item)  # every later call sees the same end
            raise item
        return item

    def make_stats(self) -> SchedulerStats:
        """EngineCore's current scheduler stats."""
        return self._call(self.client.get_stats())

    def has_unfinished_requests(self) -> bool:
        """True while some request waits or runs in EngineCore."""
        stats = self.make_stats()
        return stats.num_running_reqs + stats.num_waiting_reqs > 0

    def reset_prefix_cache(self) -> bool:
        """Drop cached blocks not in use; False if some are in use."""
        return self._call(self.client.reset_prefix_cache())

    def collective_rpc(self, method: str, args: Sequence[Any] = (),
                       kwargs: dict[str, Any] | None = None,
                       timeout: float | None = None) -> list[Any]:
        """Call a worker-extension method on every worker; one result per rank."""
        return self._call(self.client.collective_rpc(method, args, kwargs, timeout))

    def shutdown(self) -> None:
        """Stop EngineCore and the loop thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        if threading.current_thread() is self._thread:  # a finalizer run by the loop's GC
            self._loop.create_task(self.client.shutdown())
            return
        try:
            self._call(self.client.shutdown())
            self._pump.cancel()
            with contextlib.suppress(concurrent.futures.CancelledError,
                                     concurrent.futures.TimeoutError):
                self._pump.result(timeout=5)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()

