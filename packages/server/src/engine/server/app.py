"""``build_app``: the OpenAI-compatible FastAPI app around an :class:`AsyncLLM`.

Routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``,
``/ping``, ``/load``, ``/version``, ``/metrics``, ``/tokenize``, ``/detokenize``,
``POST /pooling`` (the ``--io-processor``; 404 without one), plus the routes of allowed
endpoint plugins, and with ``--enable-dev-endpoints`` ``POST /collective_rpc``.

Middleware, outermost first: the API key (:mod:`engine.server.access`: every route but the
probes and ``--public-path`` ones), the body limit (:mod:`engine.server.limits`: 413 past
``--max-request-bytes``), the load counter behind ``/load`` (:mod:`engine.server.load`).
So a request is authenticated on its headers before its body is read, and its body is
bounded before anything parses it. The app's lifespan starts the engine if it is not
running yet, initialises endpoint plugins, and shuts the engine down at exit.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from engine.core import __version__
from engine.core.client.async_llm import AsyncLLM
from engine.core.io_processing import load_io_processor
from engine.core.plugin_options import check_application_options
from engine.sdk.groups import TOOL_PARSERS
from engine.server import basic, chat, completions, dev, load, metrics, pooling, tokenize
from engine.server.access import APIKeyMiddleware, check_public_paths
from engine.server.endpoints import (
    LoadedEndpoint,
    attach_endpoint_plugins,
    init_endpoint_states,
    route_keys,
)
from engine.server.errors import install_error_handlers
from engine.server.limits import RequestSizeLimitMiddleware, check_max_request_bytes
from engine.server.state import ServerArgs, ServerState
from engine.server.tools import ToolParserSelection


def load_tool_parser(engine: AsyncLLM, args: ServerArgs) -> ToolParserSelection | None:
    """The ``--tool-call-parser``, loaded; None without ``--enable-auto-tool-choice``.

    Raises:
        ValueError: one of the two flags without the other.
        PluginError: the parser is unknown or fails to load, or a ``--plugin-option`` value
            for a tool parser is invalid.
    """
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        raise ValueError("--enable-auto-tool-choice and --tool-call-parser NAME go together "
                         "(tool_choice \"auto\" needs a parser to find the calls in the text; "
                         "built in: hermes, llama3_json)")
    # Values given to the other parsers (or to any, without one) are checked and logged.
    check_application_options(engine.setup, TOOL_PARSERS, args.tool_call_parser)
    if args.tool_call_parser is None:
        return None
    return ToolParserSelection.load(engine.setup, args.tool_call_parser,
                                    engine.tokenizer.hf_tokenizer)


def build_app(engine: AsyncLLM, args: ServerArgs | None = None) -> FastAPI:
    """The app serving ``engine`` (started by the lifespan if it is not running).

    Raises:
        PluginError: an endpoint plugin failed to load, or its routes clash with existing
            ones (the message names both); the ``--io-processor`` failed to load or
            construct.
        ValueError: a ``--public-path`` no route serves, ``--max-request-bytes`` < 1, or
            only one of ``--enable-auto-tool-choice`` and ``--tool-call-parser``.
    """
    args = args or ServerArgs()
    check_max_request_bytes(args.max_request_bytes)
    registry = CollectorRegistry()
    state = ServerState(engine=engine, args=args,
                        model_names=args.served_model_names or (engine.model_name,),
                        metrics=registry, io_processor=load_io_processor(engine.setup))
    state.tool_parser = load_tool_parser(engine, args)
    if engine.info is None:  # before start(): the stat loggers label the served name
        engine.served_model_name = state.model_name
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
    app.state.server_load = load.ServerLoad()
    install_error_handlers(app)
    for module in (completions, chat, basic, load, tokenize, metrics, pooling):
        app.include_router(module.router)
    if args.enable_dev_endpoints:
        app.include_router(dev.router)
    if args.enable_endpoint_plugins:
        loaded.extend(attach_endpoint_plugins(app, engine.setup.catalog))
    check_public_paths(args.public_paths, (path for _, path in route_keys(app.router.routes)),
                       has_api_key=bool(args.api_key))
    # add_middleware wraps what was added before: the last one added runs first.
    app.add_middleware(load.ServerLoadMiddleware, load=app.state.server_load)
    app.add_middleware(RequestSizeLimitMiddleware, max_bytes=args.max_request_bytes)
    if args.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=args.api_key,
                           public_paths=args.public_paths)
    return app
