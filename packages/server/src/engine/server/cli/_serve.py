"""``engine serve``: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from engine.core.rpc.launch import EngineLaunch
from engine.server.cli._engine_args import add_engine_args, engine_config_from_args
from engine.server.cli._help import HelpFormatter
from engine.server.cli._logging_args import add_serve_logging_args, apply_uvicorn_log_level
from engine.server.cli._port import check_can_bind
from engine.server.limits import DEFAULT_MAX_REQUEST_BYTES


def add_parser(commands: Any) -> None:
    """Register ``serve``."""
    parser = commands.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/models, /health, /ping, /load, /version, /metrics, "
        "/tokenize, /detokenize, and /pooling with --io-processor).",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("model", nargs="?", default=None,
                        help="a Hugging Face directory or a .gguf file (default: the "
                        "built-in SmolLM2-135M-Instruct)")
    parser.add_argument("--model", dest="model_option", default=None, metavar="MODEL",
                        help="the model, as vLLM also accepts it: the same as MODEL, give "
                        "one of the two (default: MODEL)")
    parser.add_argument("--config", metavar="FILE.yaml",
                        help="read options from a YAML file of option names (without the "
                        "dashes) and values, as vllm serve --config does; options on the "
                        "command line win over the file's (default: none)")
    server = parser.add_argument_group("server options")
    server.add_argument("--host", default="127.0.0.1",
                        help="interface to bind (default: 127.0.0.1, this machine only)")
    server.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    server.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="name(s) clients use in 'model' (default: the model's name); "
                        "the first is the one reported")
    server.add_argument("--api-key", default=os.environ.get("ENGINE_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on every route but "
                        "/health, /ping and --public-path ones (default: $ENGINE_API_KEY, "
                        "which keeps the key out of `ps`)")
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
    # Request limits and access (docs/serving.md, "Limits and access").
    server.add_argument("--max-request-bytes", type=_num_bytes,
                        default=DEFAULT_MAX_REQUEST_BYTES, metavar="N",
                        help="largest request body accepted; a larger one is answered 413 "
                        "before anything parses it (default: %(default)s = 32 MiB, vLLM's Rust "
                        "front end's cap: room for a 1M-token prompt as text or token ids)")
    server.add_argument("--public-path", action="append", default=[], metavar="PATH",
                        type=_route_path,
                        help="with --api-key, serve route PATH without the key too "
                        "(repeatable; e.g. /metrics for a Prometheus scraper, /docs and "
                        "/openapi.json for the API docs). /health and /ping are always open; "
                        "every other route needs the key")
    server.add_argument("--enable-server-load-tracking", action="store_true",
                        help="accepted for vLLM command lines: GET /load always counts the "
                        "generation requests in flight here, with or without it")
    tools = parser.add_argument_group("tool calling")
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="serve tool_choice \"auto\" (the default when a chat request "
                       "gives tools): the model decides whether to call, and "
                       "--tool-call-parser finds the calls in its text. \"required\" and "
                       "named choices work without it (they constrain the output)")
    tools.add_argument("--tool-call-parser", default=None, metavar="NAME",
                       help="how tool calls are written in the model's output: hermes "
                       "(<tool_call>{...}</tool_call>), llama3_json ({\"name\": ..., "
                       "\"parameters\": ...}), another engine.tool_parsers entry, or "
                       "module:Class")
    add_serve_logging_args(parser)
    add_engine_args(parser, skip=frozenset({"model"}))
    parser.set_defaults(handler=run, default_log_level="INFO")


def model_of(args: argparse.Namespace) -> str | None:
    """The model: ``MODEL`` or ``--model`` (None: the built-in default).

    Raises:
        ValueError: both are given, and differ.
    """
    if args.model is not None and args.model_option not in (None, args.model):
        raise ValueError(f"the model is given twice, as MODEL {args.model!r} and as --model "
                         f"{args.model_option!r}; give one of the two")
    model: str | None = args.model if args.model is not None else args.model_option
    return model


def _num_bytes(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of bytes, at least 1 "
                                         f"(e.g. 67108864 for 64 MiB), got {text!r}")
    return value


def _route_path(text: str) -> str:
    if not text.startswith("/"):
        raise argparse.ArgumentTypeError(f"expected a route path starting with '/', such as "
                                         f"/metrics, got {text!r}")
    return text


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
    from engine.core.heap import defer_full_collections, restore_full_collections
    from engine.core.messages import EngineDeadError
    from engine.sdk.errors import EngineSDKError

    defer_full_collections()  # freeze_startup_heap() once the engine is ready

    launch: EngineLaunch | None = None
    try:
        check_can_bind(args.host, args.port)  # a taken port is reported before the model loads
        config = engine_config_from_args(args, model=model_of(args))
        if args.in_process and args.engine_address:
            raise ValueError("--engine-address needs EngineCore in its own process; "
                             "drop --in-process")
        if not args.in_process:
            launch = EngineLaunch.spawn(config, engine_address=args.engine_address)

        from engine.server.api_server import ListenArgs, run_server
        from engine.server.state import ServerArgs

        server_args = ServerArgs(served_model_names=tuple(args.served_model_name or ()),
                                 api_key=args.api_key,
                                 enable_dev_endpoints=args.enable_dev_endpoints,
                                 max_request_bytes=args.max_request_bytes,
                                 public_paths=tuple(args.public_path),
                                 enable_log_requests=args.enable_log_requests,
                                 max_log_len=args.max_log_len,
                                 enable_auto_tool_choice=args.enable_auto_tool_choice,
                                 tool_call_parser=args.tool_call_parser)
        listen = ListenArgs(host=args.host, port=args.port,
                            graceful_timeout=args.graceful_timeout,
                            access_log=not args.disable_access_log)
        apply_uvicorn_log_level(args.uvicorn_log_level)
        return run_server(config, server_args, listen,
                          client=core_client_factory(args, launch))
    except (EngineSDKError, ValueError, EngineDeadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        restore_full_collections()  # start-up stopped early (the server froze the heap else)
        if launch is not None:
            launch.cancel()  # no-op once a client took the process over and stopped it
