"""Run the app on uvicorn, with a graceful shutdown on SIGINT / SIGTERM.

Start-up order: plugins and the model config are resolved and endpoint plugins attached
(errors stop here, before weights load), EngineCore starts (weights load), then uvicorn
binds and serves. On SIGINT or SIGTERM uvicorn stops accepting connections and lets
requests in flight finish for up to ``graceful_timeout`` seconds; then the engine shuts
down (requests still running end with an error) and the process exits with status 0.
A second SIGINT exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import uvicorn

from engine.core.client.async_llm import AsyncLLM, CoreClientFactory
from engine.core.config import EngineConfig
from engine.server.app import build_app
from engine.server.state import ServerArgs

logger = logging.getLogger("engine.server")


@dataclass(frozen=True)
class ListenArgs:
    """Where and how uvicorn listens.

    Attributes:
        host: Interface to bind (127.0.0.1 by default: not reachable from other machines).
        port: TCP port.
        graceful_timeout: Seconds requests in flight may take to finish at shutdown.
        access_log: Log one line per HTTP request.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    graceful_timeout: int = 10
    access_log: bool = True


class _Server(uvicorn.Server):
    """uvicorn's server, minus re-raising the signal after a graceful shutdown."""

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


async def serve(config: EngineConfig, server_args: ServerArgs, listen: ListenArgs, *,
                client: CoreClientFactory | None = None) -> int:
    """Build the engine and the app, serve until a signal; returns the exit status."""
    engine = AsyncLLM(config, client=client)
    app = build_app(engine, server_args)
    try:
        await engine.start()
        uv_config = uvicorn.Config(
            app, host=listen.host, port=listen.port, log_config=None,
            access_log=listen.access_log, timeout_graceful_shutdown=round(listen.graceful_timeout),
            timeout_keep_alive=5)
        server = _Server(uv_config)
        logger.info("serving %s on http://%s:%d", engine.model_name, listen.host, listen.port)
        await server.serve()
        if not server.started:
            logger.error("the server did not start (see the errors above)")
            return 1
        logger.info("server stopped")
        return 0
    finally:
        await engine.shutdown()


def run_server(config: EngineConfig, server_args: ServerArgs, listen: ListenArgs, *,
               client: CoreClientFactory | None = None) -> int:
    """Blocking entry point of ``engine serve``."""
    return asyncio.run(serve(config, server_args, listen, client=client))
