"""``InProcessCoreClient``: EngineCore on a dedicated thread of the front end's process.

The engine thread runs EngineCore's busy loop::

    while running:
        drain commands (add / abort / finish / stats / reset / stop)
        if EngineCore has work:   step() -> StepOutputs -> the event loop
        else:                     wait on the wake-up event (no busy spin)

Commands come from the event loop through a thread-safe queue and set the wake-up event;
step outputs go back with ``loop.call_soon_threadsafe`` into an ``asyncio.Queue`` that
:meth:`InProcessCoreClient.outputs` reads. An exception on the engine thread makes the
client dead: :attr:`~InProcessCoreClient.dead_error` holds an ``EngineDeadError`` whose
cause is the exception, ``outputs()`` raises it, pending calls fail with it and later calls
raise it at once, so nothing waits forever.

EngineCore itself (and the worker, weights included) is built on the engine thread, so
``start()`` does not block the event loop while weights load.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.core.client.core_client import (
    EngineCoreClient,
    EngineDeadError,
    EngineInfo,
    StepOutputs,
)
from engine.core.engine_core import EngineCore
from engine.core.startup import EngineSetup
from engine.sdk.scheduler import EngineRequest, RequestStatus
from engine.sdk.stats import SchedulerStats

logger = logging.getLogger("engine.core")

#: Builds EngineCore from a setup and an EOS id (tests pass a failing one).
CoreFactory = Callable[[EngineSetup, "int | None"], EngineCore]


def _default_core_factory(setup: EngineSetup, eos_token_id: int | None) -> EngineCore:
    return EngineCore(setup, eos_token_id=eos_token_id)


@dataclass(frozen=True)
class _Call:
    """A command answered with a result: ``fn(core)`` runs on the engine thread."""

    fn: Callable[[EngineCore], Any]
    future: asyncio.Future[Any]


_STOP = object()
#: Put on the outputs queue when the engine thread ends (dead or shut down).
_END = object()


class InProcessCoreClient(EngineCoreClient):
    """EngineCore on a thread; see the module docstring.

    Args:
        setup: The resolved engine setup (``engine.core.startup.prepare``).
        eos_token_id: The id that ends generation (from the tokenizer or model config).
        core_factory: Builds EngineCore (default: ``EngineCore(setup, eos_token_id=...)``).
    """

    def __init__(self, setup: EngineSetup, *, eos_token_id: int | None,
                 core_factory: CoreFactory = _default_core_factory) -> None:
        self.setup = setup
        self.eos_token_id = eos_token_id
        self._core_factory = core_factory
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outputs: asyncio.Queue[Any] | None = None
        self._thread: threading.Thread | None = None
        self._dead: EngineDeadError | None = None
        self._stopping = False
        self._pending: set[asyncio.Future[Any]] = set()

    # -- EngineCoreClient ------------------------------------------------------------------

    async def start(self) -> EngineInfo:
        if self._thread is not None:
            raise RuntimeError("InProcessCoreClient.start() was already called")
        self._loop = asyncio.get_running_loop()
        self._outputs = asyncio.Queue()
        ready: asyncio.Future[EngineInfo] = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, args=(ready,),
                                        name="engine-core", daemon=True)
        self._thread.start()
        return await ready

    def add_requests(self, requests: Sequence[EngineRequest]) -> None:
        self._check_alive()
        self._send(("add", tuple(requests)))

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        if request_ids and self._dead is None:
            self._send(("abort", tuple(request_ids)))

    def finish_requests(self, request_ids: Sequence[str], status: RequestStatus) -> None:
        if request_ids and self._dead is None:
            self._send(("finish", tuple(request_ids), status))

    async def outputs(self) -> AsyncIterator[StepOutputs]:
        if self._outputs is None:
            raise RuntimeError("call start() before outputs()")
        while True:
            item = await self._outputs.get()
            if item is _END:
                self._outputs.put_nowait(_END)  # every reader sees the end
                if self._dead is not None and not self._stopping:
                    raise self._dead
                return
            yield item

    async def is_healthy(self) -> bool:
        thread = self._thread
        return self._dead is None and thread is not None and thread.is_alive()

    async def get_stats(self) -> SchedulerStats:
        stats: SchedulerStats = await self._call(lambda core: core.make_stats())
        return stats

    async def reset_prefix_cache(self) -> bool:
        return bool(await self._call(lambda core: core.reset_prefix_cache()))

    async def shutdown(self) -> None:
        thread = self._thread
        if thread is None or self._stopping:
            return
        self._stopping = True
        self._send(_STOP)
        while thread.is_alive():  # polled: no executor threads at interpreter exit
            await asyncio.sleep(0.01)

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead

    # -- event-loop side -------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._stopping:
            raise EngineDeadError("EngineCore is shutting down")

    def _send(self, command: Any) -> None:
        self._commands.put(command)
        self._wake.set()

    async def _call(self, fn: Callable[[EngineCore], Any]) -> Any:
        self._check_alive()
        assert self._loop is not None
        future = self._loop.create_future()
        self._pending.add(future)
        try:
            self._send(_Call(fn, future))
            return await future
        finally:
            self._pending.discard(future)

    def _on_end(self, error: BaseException | None) -> None:
        """Runs on the event loop once the engine thread ends."""
        if error is not None and self._dead is None:
            dead = EngineDeadError(f"EngineCore died: {type(error).__name__}: {error}")
            dead.__cause__ = error
            self._dead = dead
        elif self._dead is None:
            self._dead = EngineDeadError("EngineCore was shut down")
        for future in list(self._pending):
            if not future.done():
                future.set_exception(self._dead)
        assert self._outputs is not None
        self._outputs.put_nowait(_END)

    # -- engine thread ---------------------------------------------------------------------

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _run(self, ready: asyncio.Future[EngineInfo]) -> None:
        error: BaseException | None = None
        core: EngineCore | None = None
        try:
            core = self._core_factory(self.setup, self.eos_token_id)
            self._post(_resolve, ready, core.info(), None)
            self._busy_loop(core)
        except BaseException as exc:
            error = exc
            logger.exception("EngineCore failed")
            self._post(_resolve, ready, None, EngineDeadError(
                f"EngineCore failed: {type(exc).__name__}: {exc}"))
        finally:
            if core is not None:
                try:
                    core.shutdown()
                except Exception:
                    logger.exception("EngineCore shutdown failed")
            self._post(self._on_end, error)

    def _busy_loop(self, core: EngineCore) -> None:
        scheduler = core.scheduler
        while True:
            self._wake.clear()
            if not self._drain(core):
                return
            if scheduler.has_unfinished_requests() or scheduler.has_finished_requests():
                outputs = core.step()
                step = StepOutputs(outputs, core.make_stats(), time.time())
                assert self._outputs is not None
                self._post(self._outputs.put_nowait, step)
            else:
                self._wake.wait()

    def _drain(self, core: EngineCore) -> bool:
        """Apply every queued command; False when asked to stop."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
            if command is _STOP:
                return False
            if isinstance(command, _Call):
                try:
                    result, exc = command.fn(core), None
                except Exception as error:  # noqa: BLE001 - handed to the caller
                    result, exc = None, error
                self._post(_resolve, command.future, result, exc)
            elif command[0] == "add":
                for request in command[1]:
                    core.add_request(request)
            elif command[0] == "abort":
                core.abort_requests(command[1])
            else:
                core.finish_requests(command[1], command[2])


def _resolve(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
