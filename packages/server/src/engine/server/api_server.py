"""Run the app on uvicorn: a graceful shutdown on SIGINT / SIGTERM, an exit when EngineCore dies.

Start-up order: plugins and the model config are resolved and endpoint plugins attached
(errors stop here, before weights load), EngineCore starts (weights load), then uvicorn
binds and serves.

Shutdown, on SIGINT or SIGTERM:

1. uvicorn stops accepting connections, closes idle keep-alive ones, and lets requests in
   flight finish for up to ``graceful_timeout`` seconds;
2. requests still running then end with the documented error, not a cancelled task: the
   engine shuts down with a reason, so a non-streaming client gets a 503
   ``engine_unavailable`` JSON body and a stream gets an error frame then
   ``data: [DONE]``; uvicorn waits for those answers (a last resort cancels whatever still
   runs :data:`END_GRACE_S` later);
3. EngineCore (and its workers) stop, and the process ends with status 0. A second SIGINT
   exits at once.

When EngineCore dies on its own (killed, a worker died, a step raised), every request gets
a 503 at once; the server keeps answering (``/health`` 503 with the reason, ``/metrics``
with ``engine:engine_alive 0``) for ``engine_death_exit_delay`` seconds, so probes, load
balancers and a scrape see why, then shuts down as above and exits with status 1, for a
supervisor (systemd, Kubernetes) to start a fresh server: vLLM's behaviour.

:func:`run_server` ends the process itself once everything has stopped: the interpreter's
own teardown (a garbage collection over torch's and transformers' modules) would take
another 1-3 s after "server stopped", with nothing left to clean up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import uvicorn

from engine.core.client.async_llm import AsyncLLM, CoreClientFactory
from engine.core.config import EngineConfig
from engine.core.heap import freeze_startup_heap
from engine.core.rpc.process import exit_process
from engine.server.app import build_app
from engine.server.state import ServerArgs

logger = logging.getLogger("engine.server")

T = TypeVar("T")

#: Seconds requests ended at the graceful timeout get to send their error before uvicorn
#: cancels them (a last resort: ending a request takes milliseconds).
END_GRACE_S = 5.0
#: Exit status of ``engine serve`` after EngineCore died.
ENGINE_DEAD_EXIT_STATUS = 1


@dataclass(frozen=True)
class ListenArgs:
    """Where and how uvicorn listens, and how the server ends.

    Attributes:
        host: Interface to bind (127.0.0.1 by default: not reachable from other machines).
        port: TCP port.
        graceful_timeout: Seconds requests in flight may take to finish at shutdown; those
            still running then end with a 503 ``engine_unavailable``.
        access_log: Log one line per HTTP request.
        engine_death_exit_delay: Seconds the server keeps answering 503 after EngineCore
            died, before it exits with status 1.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    graceful_timeout: int = 10
    access_log: bool = True
    engine_death_exit_delay: float = 5.0


class _Server(uvicorn.Server):
    """uvicorn's server, with two changes to how it stops.

    It does not re-raise the signal after a graceful shutdown, and requests still running
    at the graceful timeout are ended by ``end_requests`` (which answers them) instead of
    cancelled.
    """

    def __init__(self, config: uvicorn.Config, *, graceful_timeout: float,
                 end_requests: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self._graceful_timeout = graceful_timeout
        self._end_requests = end_requests

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    async def _wait_tasks_to_complete(self) -> None:
        # uvicorn runs this under its own timeout (graceful_timeout + END_GRACE_S), after
        # which it cancels the tasks left.
        wait_all = asyncio.ensure_future(super()._wait_tasks_to_complete())
        try:
            done, _ = await asyncio.wait({wait_all}, timeout=self._graceful_timeout)
            if not done:
                logger.warning(
                    "%d request(s) still running after the graceful timeout of %g s: ending "
                    "them with 503 engine_unavailable", len(self.server_state.tasks),
                    self._graceful_timeout)
                await self._end_requests()
            await wait_all
        finally:
            wait_all.cancel()


async def _exit_when_engine_dies(engine: AsyncLLM, server: uvicorn.Server, delay: float,
                                 died: list[bool]) -> None:
    error = await engine.wait_for_death()
    died.append(True)
    logger.warning("EngineCore is dead (%s): every request is answered with 503; the server "
                   "exits with status %d in %g s, for its supervisor to start a fresh one",
                   error, ENGINE_DEAD_EXIT_STATUS, delay)
    await asyncio.sleep(delay)
    server.should_exit = True


async def serve(config: EngineConfig, server_args: ServerArgs, listen: ListenArgs, *,
                client: CoreClientFactory | None = None) -> int:
    """Build the engine and the app, serve until a signal or EngineCore's death.

    Returns:
        The exit status: 0 after a shutdown by signal, 1 if the server did not start or
        EngineCore died.
    """
    engine = AsyncLLM(config, client=client)  # build_app gives it the served model name
    app = build_app(engine, server_args)
    watcher: asyncio.Task[None] | None = None
    try:
        await engine.start()
        freeze_startup_heap()
        uv_config = uvicorn.Config(
            app, host=listen.host, port=listen.port, log_config=None,
            access_log=listen.access_log,
            timeout_graceful_shutdown=round(listen.graceful_timeout + END_GRACE_S),
            timeout_keep_alive=5)
        reason = (f"the server is shutting down: requests still running after the "
                  f"--graceful-timeout of {listen.graceful_timeout} s are ended")
        server = _Server(uv_config, graceful_timeout=listen.graceful_timeout,
                         end_requests=lambda: engine.shutdown(reason))
        died: list[bool] = []
        watcher = asyncio.create_task(_exit_when_engine_dies(
            engine, server, listen.engine_death_exit_delay, died), name="engine-death-exit")
        logger.info("serving %s on http://%s:%d", engine.model_name, listen.host, listen.port)
        await server.serve()
        if not server.started:
            logger.error("the server did not start (see the errors above)")
            return 1
        logger.info("server stopped")
        return ENGINE_DEAD_EXIT_STATUS if died else 0
    finally:
        if watcher is not None:
            watcher.cancel()
        await engine.shutdown()


def run_server(config: EngineConfig, server_args: ServerArgs, listen: ListenArgs, *,
               client: CoreClientFactory | None = None) -> NoReturn:
    """Blocking entry point of ``engine serve``: serve, then end the process with the status.

    Returns only by raising (the engine or the app could not be built or started). Once
    :func:`serve` returned, EngineCore and its workers are stopped and reaped and the
    socket directory is gone; the process then runs its ``atexit`` handlers (logging,
    multiprocessing) and ends without the interpreter's slow teardown.
    """
    status = run_event_loop(serve(config, server_args, listen, client=client))
    exit_process(status)


def run_event_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to the end on uvloop, or on asyncio's own loop where uvloop is missing.

    engine-server depends on uvloop (except on Windows, which it does not support), as
    uvicorn's ``standard`` extra and vLLM's server do: the server's per-token work (one
    socket write and one task wake-up per token of each stream) costs ~20% less CPU on it
    with httptools (benchmarks/README.md), CPU the model's threads get back.
    """
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
