"""``engine serve``: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from engine.core.rpc.launch import EngineLaunch
from engine.server.cli._engine_args import add_engine_args, engine_config_from_args


def add_parser(commands: Any) -> None:
    """Register ``serve``."""
    parser = commands.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/models, /health, /version, /metrics, /tokenize, "
        "/detokenize, and /pooling with --io-processor).",
    )
    parser.add_argument("model", nargs="?", default=None,
                        help="a Hugging Face directory or a .gguf file (default: the "
                        "built-in SmolLM2-135M-Instruct)")
    server = parser.add_argument_group("server options")
    server.add_argument("--host", default="127.0.0.1",
                        help="interface to bind (default: 127.0.0.1, this machine only)")
    server.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    server.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="name(s) clients use in 'model' (default: the model's name); "
                        "the first is the one reported")
    server.add_argument("--api-key", default=os.environ.get("ENGINE_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1/* requests "
                        "(default: $ENGINE_API_KEY, which keeps the key out of `ps`)")
    server.add_argument("--in-process", action="store_true",
                        help="run EngineCore on a thread of the server process instead of "
                        "its own process (debugging, tests)")
    server.add_argument("--engine-address", default=None, metavar="HOST:PORT",
                        help="serve EngineCore's gRPC channel on TCP HOST:PORT (with a "
                        "per-launch secret checked on every call) instead of a private unix "
                        "socket")
    server.add_argument("--graceful-timeout", type=int, default=10,
                        help="seconds requests in flight may take to finish at shutdown")
    server.add_argument("--enable-dev-endpoints", action="store_true",
                        help="serve POST /collective_rpc (calls worker-extension methods on "
                        "every worker; behind --api-key when one is set)")
    server.add_argument("--disable-access-log", action="store_true",
                        help="do not log one line per HTTP request")
    add_engine_args(parser, skip=frozenset({"model"}))
    parser.set_defaults(handler=run, default_log_level="INFO")


def core_client_factory(args: argparse.Namespace, launch: EngineLaunch | None) -> Any:
    """The EngineCore transport for ``engine serve``: the one place it is chosen.

    Default: EngineCore in its own process (``launch``, spawned already) behind gRPC on a
    private unix socket, or on ``--engine-address`` TCP. ``--in-process`` runs it on a
    thread of the server process instead.
    """
    if launch is None:
        from engine.core.client.async_llm import in_process_client

        return in_process_client
    import functools

    from engine.core.rpc import GrpcCoreClient

    return functools.partial(GrpcCoreClient.factory, engine_address=args.engine_address,
                             launch=launch)


def run(args: argparse.Namespace) -> int:
    """``engine serve``.

    EngineCore's process is spawned as soon as the config is valid, before this process
    imports torch and the server, so both start up in parallel.
    """
    from engine.core.messages import EngineDeadError
    from engine.sdk.errors import EngineSDKError

    launch: EngineLaunch | None = None
    try:
        config = engine_config_from_args(args, model=args.model)
        if args.in_process and args.engine_address:
            raise ValueError("--engine-address needs EngineCore in its own process; "
                             "drop --in-process")
        if not args.in_process:
            launch = EngineLaunch.spawn(config, engine_address=args.engine_address)

        from engine.server.api_server import ListenArgs, run_server
        from engine.server.state import ServerArgs

        server_args = ServerArgs(served_model_names=tuple(args.served_model_name or ()),
                                 api_key=args.api_key,
                                 enable_dev_endpoints=args.enable_dev_endpoints)
        listen = ListenArgs(host=args.host, port=args.port,
                            graceful_timeout=args.graceful_timeout,
                            access_log=not args.disable_access_log)
        return run_server(config, server_args, listen,
                          client=core_client_factory(args, launch))
    except (EngineSDKError, ValueError, EngineDeadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if launch is not None:
            launch.cancel()  # no-op once a client took the process over and stopped it
