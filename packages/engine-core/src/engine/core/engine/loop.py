"""EngineCore's one busy loop, driven the same way in-process and over gRPC.

::

    callers (gRPC handler threads, or the        loop thread (EngineLoop.run)
    in-process client's event loop)              ----------------------------
    --------------------------------
    add / abort / finish / call  --submit-->  inbox (deque + wake event)
                                                 |
                                                 v
                                 drain the inbox: run each item (adds, aborts, calls)
                                 if work: core.step() -> StepOutputs -> sink.publish()
                                 else: sleep on the wake event (no busy spin when idle)

Everything that touches the scheduler runs on the loop thread, between steps, as the
``SchedulerInterface`` contract requires; callers only append callables to the inbox
(``deque.append`` is atomic) and set the wake event. The transport plugs in an
:class:`OutputSink`: the gRPC stream encodes each step into one ``ServerMessage``, the
in-process client hands it to its asyncio loop.

Failure policy, the same for both transports:

* a request the scheduler refuses (``add_request`` raises) ends at once with
  ``finish_reason="abort"``; everyone else is served;
* an exception in a step (the scheduler, the executor, a worker that died) stops the loop:
  :attr:`EngineLoop.error` describes it, pending calls fail, the sink is closed with it,
  and the exception propagates out of :meth:`EngineLoop.run`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

from engine.core.messages import StepOutputs
from engine.sdk.scheduler import EngineCoreOutput, EngineRequest, RequestStatus

if TYPE_CHECKING:
    from engine.core.engine.engine_core import EngineCore

logger = logging.getLogger("engine.core")

T = TypeVar("T")

#: How long the idle loop sleeps before it looks at its stop flag again (the wake event
#: usually ends the sleep much earlier).
IDLE_WAIT_S = 1.0


class LoopStoppedError(RuntimeError):
    """The busy loop has stopped: EngineCore no longer serves calls."""


class OutputSink(ABC):
    """Where one front end's step outputs go; also records the requests it added.

    Attributes:
        request_ids: The requests this front end added that have not finished (aborted
            when it detaches).
    """

    def __init__(self) -> None:
        self.request_ids: set[str] = set()

    @abstractmethod
    def publish(self, step: StepOutputs) -> None:
        """Deliver one step's outputs (called on the loop thread; must not block long)."""

    @abstractmethod
    def close(self, error: str | None) -> None:
        """The loop stopped; ``error`` says why when it failed (called once)."""


class _Call:
    """A function to run on the loop thread, with a future for its result."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.future: Future[Any] = Future()

    def __call__(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            self.future.set_result(self.fn())
        except Exception as exc:  # noqa: BLE001 - handed to the caller's thread
            self.future.set_exception(exc)


class _Failure:
    """An inbox item that stops the loop with ``error`` (e.g. a worker died while idle)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __call__(self) -> None:
        raise self.error


class EngineLoop:
    """Runs ``EngineCore`` on the calling thread and publishes each step's outputs.

    Args:
        core: The engine core; only the loop thread touches it after construction. Its
            executor reports worker deaths to :meth:`fail`.
    """

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._inbox: collections.deque[Callable[[], None]] = collections.deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._sink: OutputSink | None = None
        self._pending: list[EngineCoreOutput] = []  # outputs made outside a step
        self.error: str | None = None
        core.on_failure(self.fail)

    # --- callable from any thread ---------------------------------------------------------

    def submit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop thread before the next step (non-blocking)."""
        if self._stopped.is_set():
            raise LoopStoppedError(self.error or "EngineCore is stopping")
        self._inbox.append(fn)
        self._wake.set()

    def call_future(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the loop thread; its result (or exception) arrives in the future."""
        item = _Call(fn)
        self.submit(item)
        return item.future

    def call(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Run ``fn`` on the loop thread and wait for its result.

        Raises:
            LoopStoppedError: the loop stopped before it ran ``fn``.
            TimeoutError: no result within ``timeout`` seconds.
        """
        result: T = self.call_future(fn).result(timeout)
        return result

    def attach(self, sink: OutputSink) -> None:
        """Make ``sink`` the front end that receives step outputs."""
        self.submit(lambda: setattr(self, "_sink", sink))

    def detach(self, sink: OutputSink) -> None:
        """The front end of ``sink`` went away: abort the requests it added."""
        def run() -> None:
            if self._sink is sink:
                self._sink = None
            if sink.request_ids:
                logger.warning("front end stream closed; aborting its %d request(s)",
                               len(sink.request_ids))
                self.core.abort_requests(list(sink.request_ids))
                sink.request_ids.clear()
        try:
            self.submit(run)
        except LoopStoppedError:
            pass

    def add_requests(self, sink: OutputSink, requests: Sequence[EngineRequest]) -> None:
        """Queue requests from the front end of ``sink``."""
        self.submit(lambda: self._add(sink, requests))

    def abort_requests(self, sink: OutputSink, request_ids: Sequence[str]) -> None:
        """Queue an abort."""
        def run() -> None:
            self.core.abort_requests(request_ids)
            sink.request_ids.difference_update(request_ids)
        self.submit(run)

    def finish_requests(self, sink: OutputSink, request_ids: Sequence[str],
                        status: RequestStatus) -> None:
        """Queue a finish with ``status``."""
        def run() -> None:
            self.core.finish_requests(request_ids, status)
            sink.request_ids.difference_update(request_ids)
        self.submit(run)

    def reject(self, request_ids: Iterable[str], reason: str) -> None:
        """End requests that never reached the scheduler (their message was malformed)."""
        ids = list(request_ids)
        logger.error("rejected request(s) %s: %s", ", ".join(ids), reason)
        self.submit(lambda: self._pending.extend(
            EngineCoreOutput(request_id=i, new_token_ids=(), finish_reason="abort")
            for i in ids))

    def fail(self, error: BaseException) -> None:
        """Stop the loop with ``error`` as soon as the loop thread is free (any thread)."""
        try:
            self.submit(_Failure(error))
        except LoopStoppedError:
            pass

    def stop(self) -> None:
        """Ask the loop to stop after the current step (callable from any thread)."""
        self._stop.set()
        self._wake.set()

    @property
    def is_running(self) -> bool:
        """True until the loop has stopped (cleanly or after an error)."""
        return not self._stopped.is_set()

    # --- the loop thread ------------------------------------------------------------------

    def run(self) -> None:
        """Serve until :meth:`stop`; an exception in a step is published, then re-raised."""
        try:
            while not self._stop.is_set():
                self._wake.clear()
                self._drain()
                if self.core.has_work() or self._pending:
                    self._step()
                else:
                    self._wake.wait(IDLE_WAIT_S)
        except BaseException as exc:
            self.error = f"EngineCore failed: {type(exc).__name__}: {exc}"
            logger.exception("EngineCore busy loop failed")
            raise
        finally:
            self._stopped.set()
            self._close()

    def _drain(self) -> None:
        while True:
            try:
                item = self._inbox.popleft()
            except IndexError:
                return
            item()

    def _step(self) -> None:
        outputs = self.core.step()
        if self._pending:
            outputs = [*self._pending, *outputs]
            self._pending.clear()
        if not outputs:
            return
        sink = self._sink
        if sink is None:
            logger.debug("dropping %d output(s): no front end connected", len(outputs))
            return
        for output in outputs:
            if output.finish_reason is not None:
                sink.request_ids.discard(output.request_id)
        sink.publish(StepOutputs(outputs, self.core.make_stats(), time.time()))

    def _add(self, sink: OutputSink, requests: Sequence[EngineRequest]) -> None:
        for request in requests:
            try:
                self.core.add_request(request)
            except Exception as exc:  # noqa: BLE001 - one bad request must not stop the engine
                logger.error("request %s refused by the scheduler: %s", request.request_id, exc)
                self._pending.append(EngineCoreOutput(
                    request_id=request.request_id, new_token_ids=(), finish_reason="abort"))
            else:
                sink.request_ids.add(request.request_id)

    def _close(self) -> None:
        """Fail calls still queued and close the connected sink."""
        while True:
            try:
                item = self._inbox.popleft()
            except IndexError:
                break
            if isinstance(item, _Call):
                item.future.set_exception(LoopStoppedError(self.error or "EngineCore stopped"))
        if self._sink is not None:
            self._sink.close(self.error)
