"""Starting the EngineCore process: private channel, spawn, wait for readiness.

The front end (``GrpcCoreClient``) chooses the channel (:func:`channel_args`): a unix socket
in a fresh directory with mode 0700, or TCP with a per-launch secret. It then spawns the
process (:func:`spawn_engine_core`, multiprocessing ``spawn``: never ``fork``, which would
copy the front end's threads and event loop) and waits for its one readiness message, or
its start-up error, on a pipe (:func:`wait_ready`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import secrets
import shutil
import signal
import tempfile
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from engine.core.client.core_client import EngineDeadError
from engine.core.rpc.process import EngineProcessArgs, run_engine_core_process

SOCKET_NAME = "engine_core.sock"


def make_socket_dir() -> str:
    """A fresh directory with mode 0700 for the unix socket (short path: sockets cap ~107)."""
    base = tempfile.gettempdir()
    if len(base) > 60:
        base = "/tmp"
    path = tempfile.mkdtemp(prefix="engine-", dir=base)
    os.chmod(path, 0o700)
    return path


def channel_args(engine_address: str | None) -> tuple[str, str | None, str | None]:
    """``(listen address, secret, socket dir)`` for one launch.

    ``engine_address=None``: a unix socket in a new 0700 directory, no secret.
    ``"host:port"``: TCP, with a new secret from :func:`secrets.token_urlsafe`.
    """
    if engine_address is None:
        socket_dir = make_socket_dir()
        return f"unix:{os.path.join(socket_dir, SOCKET_NAME)}", None, socket_dir
    return engine_address, secrets.token_urlsafe(32), None


def client_address(bound: str) -> str:
    """Where a local client connects to a server bound at ``bound`` (0.0.0.0 -> 127.0.0.1)."""
    if bound.startswith("unix:"):
        return bound
    host, _, port = bound.rpartition(":")
    return f"{'127.0.0.1' if host in ('', '0.0.0.0', '[::]') else host}:{port}"


def describe_exit(exitcode: int | None) -> str:
    """``exit code 1`` or ``killed by SIGKILL``."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit code {exitcode}"


def spawn_engine_core(args: EngineProcessArgs) -> tuple[BaseProcess, Connection]:
    """Start the EngineCore process; returns it and the pipe its readiness arrives on."""
    context = multiprocessing.get_context("spawn")
    reader, writer = context.Pipe(duplex=False)
    process = context.Process(target=run_engine_core_process, args=(args, writer),
                              name="EngineCore", daemon=False)  # daemons cannot have workers
    process.start()
    writer.close()
    return process, reader


async def wait_ready(reader: Connection, process: BaseProcess, timeout: float) -> str:
    """The address the process listens on, once it is ready.

    Raises:
        EngineDeadError: with the process's start-up error, its exit status, or the timeout.
    """
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)
    loop.add_reader(reader.fileno(), wake)
    loop.add_reader(process.sentinel, wake)
    try:
        await asyncio.wait_for(ready, timeout)
    except asyncio.TimeoutError:
        raise EngineDeadError(f"EngineCore did not start within {timeout:g} s") from None
    finally:
        loop.remove_reader(reader.fileno())
        loop.remove_reader(process.sentinel)
    message: dict[str, Any] = {}
    with contextlib.suppress(EOFError, OSError):
        if reader.poll():
            message = json.loads(reader.recv_bytes())
    if "ready" in message:
        return str(message["ready"])
    if "error" in message:
        raise EngineDeadError(f"EngineCore failed to start: {message['error']}")
    await asyncio.to_thread(process.join, 5)
    raise EngineDeadError(f"EngineCore exited before it was ready "
                          f"({describe_exit(process.exitcode)})")


def reap(process: BaseProcess, socket_dir: str | None) -> None:
    """Last resort (garbage collection or interpreter exit without ``shutdown()``)."""
    if process.is_alive():
        process.kill()
    process.join(5)
    if socket_dir:
        shutil.rmtree(socket_dir, ignore_errors=True)
