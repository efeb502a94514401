"""``build_app``: the OpenAI-compatible FastAPI app around an :class:`AsyncLLM`.

Routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``,
``/version``, ``/metrics``, ``/tokenize``, ``/detokenize``, ``POST /pooling`` (the
``--io-processor``; 404 without one), plus the routes of allowed endpoint plugins, and
with ``--enable-dev-endpoints`` ``POST /collective_rpc``. ``--api-key`` protects
``/v1/*``, ``/pooling`` and the dev endpoints. The app's lifespan starts the engine
if it is not running yet, initialises endpoint plugins, and shuts the engine down at exit.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.core import __version__
from engine.core.client.async_llm import AsyncLLM
from engine.core.io_processing import load_io_processor
from engine.server import basic, chat, completions, dev, metrics, pooling, tokenize
from engine.server.endpoints import (
    LoadedEndpoint,
    attach_endpoint_plugins,
    init_endpoint_states,
)
from engine.server.errors import error_response, install_error_handlers
from engine.server.state import ServerArgs, ServerState


class APIKeyMiddleware:
    """Refuse ``/v1/*`` (and ``paths``) requests without ``Authorization: Bearer <key>``."""

    def __init__(self, app: ASGIApp, api_key: str, paths: tuple[str, ...] = ()) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._paths = frozenset(paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (scope["path"].startswith("/v1/")
                                        or scope["path"] in self._paths):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                response = error_response(
                    401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: AsyncLLM, args: ServerArgs | None = None) -> FastAPI:
    """The app serving ``engine`` (started by the lifespan if it is not running).

    Raises:
        PluginError: an endpoint plugin failed to load, or its routes clash with existing
            ones (the message names both); the ``--io-processor`` failed to load or
            construct.
    """
    args = args or ServerArgs()
    registry = CollectorRegistry()
    state = ServerState(engine=engine, args=args,
                        model_names=args.served_model_names or (engine.model_name,),
                        metrics=registry, io_processor=load_io_processor(engine.setup))
    engine.add_stat_logger("prometheus",
                           lambda ctx: metrics.PrometheusStatLogger(ctx, registry))
    loaded: list[LoadedEndpoint] = []

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if engine.info is None:
            await engine.start()
        await init_endpoint_states(loaded, engine, app.state)
        try:
            yield
        finally:
            await engine.shutdown()

    app = FastAPI(title="engine", version=__version__, lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    for module in (completions, chat, basic, tokenize, metrics, pooling):
        app.include_router(module.router)
    if args.enable_dev_endpoints:
        app.include_router(dev.router)
    if args.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=args.api_key, paths=(
            pooling.PATH, *(dev.PATHS if args.enable_dev_endpoints else ())))
    if args.enable_endpoint_plugins:
        loaded.extend(attach_endpoint_plugins(app, engine.setup.catalog))
    return app

