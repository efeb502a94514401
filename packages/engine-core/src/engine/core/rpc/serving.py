"""Starting a gRPC server on a private channel: the one recipe both servers use."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from engine.core.rpc.server_auth import SecretInterceptor


def start_grpc_server(add_servicer: Callable[[grpc.Server], None], address: str, *,
                      secret: str | None, executor: ThreadPoolExecutor,
                      options: list[tuple[str, Any]], who: str,
                      refusal: str) -> tuple[grpc.Server, str]:
    """Build, bind and start a server on ``address`` (``unix:PATH`` or ``HOST:PORT``).

    Args:
        add_servicer: Registers the servicer on the new server.
        address: ``unix:PATH``, or ``HOST:PORT`` (``HOST:0`` picks a free port).
        secret: Required as ``x-engine-secret`` on every call (mandatory over TCP).
        executor: The thread pool the handlers run on (the caller shuts it down).
        options: gRPC server options.
        who: The server in error messages (``EngineCore``, ``worker rank 1``).
        refusal: What a call with a wrong secret is told.

    Returns:
        The started server and the address it listens on (the real port for ``:0``).

    Raises:
        ValueError: a TCP address without a secret.
        RuntimeError: the address could not be bound.
    """
    is_unix = address.startswith("unix:")
    if not is_unix and not secret:
        raise ValueError(f"{who} served over TCP needs a per-launch secret")
    server = grpc.server(
        executor, interceptors=[SecretInterceptor(secret, refusal=refusal)] if secret else [],
        options=options,
    )
    add_servicer(server)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise RuntimeError(f"{who} could not listen on {address}: {exc}") from exc
    if not is_unix and port == 0:
        raise RuntimeError(f"{who} could not listen on {address}")
    server.start()
    bound = address if is_unix else f"{address.rsplit(':', 1)[0]}:{port}"
    return server, bound
