"""``InProcessCoreClient``: EngineCore's busy loop on a dedicated thread of this process.

The thread builds EngineCore (weights included, so ``start()`` does not block the event
loop while they load) and runs the same :class:`~engine.core.engine.loop.EngineLoop` the
EngineCore process runs, with an :class:`OutputSink` that hands each step to the event loop
(``call_soon_threadsafe`` into an ``asyncio.Queue`` that :meth:`outputs` reads). Commands
(add / abort / finish) and calls (stats, prefix-cache reset, collective_rpc) go through the
loop's inbox, exactly as gRPC handler threads send them in the EngineCore process, so both
transports share one failure policy: a request the scheduler refuses ends as aborted, and
an exception in a step makes the client dead. :attr:`~InProcessCoreClient.dead_error` then
holds an ``EngineDeadError`` whose cause is the exception; ``outputs()`` raises it, pending
calls fail with it and later calls raise it at once, so nothing waits forever.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from engine.core.client.core_client import EngineCoreClient
from engine.core.engine.engine_core import EngineCore
from engine.core.engine.loop import EngineLoop, LoopStoppedError, OutputSink
from engine.core.messages import EngineDeadError, EngineInfo, StepOutputs
from engine.core.startup import EngineSetup
from engine.sdk.scheduler import EngineRequest, RequestStatus
from engine.sdk.stats import SchedulerStats

logger = logging.getLogger("engine.core")

#: Builds EngineCore from a setup and an EOS id (tests pass a failing one).
CoreFactory = Callable[[EngineSetup, "int | None"], EngineCore]

#: Put on the outputs queue when the engine thread ends (dead or shut down).
_END = object()


def _default_core_factory(setup: EngineSetup, eos_token_id: int | None) -> EngineCore:
    return EngineCore(setup, eos_token_id=eos_token_id)


class _EventLoopSink(OutputSink):
    """Hands steps to the client's event loop."""

    def __init__(self, client: InProcessCoreClient) -> None:
        super().__init__()
        self._client = client

    def publish(self, step: StepOutputs) -> None:
        assert self._client._outputs is not None
        self._client._post(self._client._outputs.put_nowait, step)

    def close(self, error: str | None) -> None:
        """Nothing to do: the thread reports the end when the loop has returned."""


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
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._outputs: asyncio.Queue[Any] | None = None
        self._thread: threading.Thread | None = None
        self._engine_loop: EngineLoop | None = None
        self._sink = _EventLoopSink(self)
        self._dead: EngineDeadError | None = None
        self._stopping = False
        self._pending: set[asyncio.Future[Any]] = set()

    # -- EngineCoreClient ------------------------------------------------------------------

    async def start(self) -> EngineInfo:
        if self._thread is not None:
            raise RuntimeError("InProcessCoreClient.start() was already called")
        self._event_loop = asyncio.get_running_loop()
        self._outputs = asyncio.Queue()
        ready: asyncio.Future[EngineInfo] = self._event_loop.create_future()
        self._thread = threading.Thread(target=self._run, args=(ready,),
                                        name="engine-core", daemon=True)
        self._thread.start()
        return await ready

    def add_requests(self, requests: Sequence[EngineRequest]) -> None:
        self._loop().add_requests(self._sink, tuple(requests))

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        if request_ids and self._dead is None and self._engine_loop is not None:
            self._engine_loop.abort_requests(self._sink, tuple(request_ids))

    def finish_requests(self, request_ids: Sequence[str], status: RequestStatus) -> None:
        if request_ids and self._dead is None and self._engine_loop is not None:
            self._engine_loop.finish_requests(self._sink, tuple(request_ids), status)

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

    async def collective_rpc(self, method: str, args: Sequence[Any] = (),
                             kwargs: dict[str, Any] | None = None,
                             timeout: float | None = None) -> list[Any]:
        results: list[Any] = await self._call(
            lambda core: core.collective_rpc(method, args, kwargs, timeout))
        return results

    async def shutdown(self) -> None:
        thread = self._thread
        if thread is None or self._stopping:
            return
        self._stopping = True
        if self._engine_loop is not None:
            self._engine_loop.stop()
        while thread.is_alive():  # polled: no executor threads at interpreter exit
            await asyncio.sleep(0.01)

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead

    # -- event-loop side -------------------------------------------------------------------

    def _loop(self) -> EngineLoop:
        if self._dead is not None:
            raise self._dead
        if self._stopping or self._engine_loop is None:
            raise EngineDeadError("EngineCore is shutting down")
        return self._engine_loop

    async def _call(self, fn: Callable[[EngineCore], Any]) -> Any:
        engine_loop = self._loop()
        try:
            future = asyncio.wrap_future(engine_loop.call_future(
                lambda: fn(engine_loop.core)))
        except LoopStoppedError:
            raise self._dead or EngineDeadError("EngineCore stopped") from None
        self._pending.add(future)
        try:
            return await future
        except LoopStoppedError:
            raise self._dead or EngineDeadError("EngineCore stopped") from None
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
        assert self._event_loop is not None
        try:
            self._event_loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _run(self, ready: asyncio.Future[EngineInfo]) -> None:
        error: BaseException | None = None
        core: EngineCore | None = None
        try:
            core = self._core_factory(self.setup, self.eos_token_id)
            engine_loop = EngineLoop(core)
            engine_loop.attach(self._sink)
            self._engine_loop = engine_loop
            if self._stopping:
                engine_loop.stop()
            self._post(_resolve, ready, core.info(), None)
            engine_loop.run()
        except BaseException as exc:
            error = exc
            if core is None:
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


def _resolve(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
