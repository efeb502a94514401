"""Starting the EngineCore process: private channel, spawn, settings, readiness.

:meth:`EngineLaunch.spawn` chooses the channel (:func:`channel_args`: a unix socket in a
fresh directory with mode 0700, or TCP with a per-launch secret) and spawns the process
(multiprocessing ``spawn``: never ``fork``, which would copy the front end's threads and
event loop) from the config alone, so it can start as early as possible: the process
imports torch and reads the model's config while the front end does the same. What only
the front end knows later (its plugin manifest, the tokenizer's EOS id) follows over a
pipe (:meth:`EngineLaunch.send_settings`); the process waits for it before it builds
anything from plugins, then sends one readiness message, or its start-up error, back
(:meth:`EngineLaunch.wait_ready`)::

    launch = EngineLaunch.spawn(config)          # right after the command line is parsed
    ...                                          # the front end's own start-up, in parallel
    launch.send_settings(manifest, eos_token_id)
    address = await launch.wait_ready(timeout)

Whoever spawned it owns it until a ``GrpcCoreClient`` takes it over; :meth:`cancel` (also
run at garbage collection and interpreter exit) kills and reaps it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import multiprocessing
import os
import secrets
import shutil
import signal
import tempfile
import time
import weakref
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from engine.core.config import EngineConfig
from engine.core.cpu_threads import yielding_waits
from engine.core.messages import EngineDeadError
from engine.core.plugins import PluginManifest
from engine.core.plugins._local import check_no_local_classes
from engine.core.rpc.huge_pages import huge_page_malloc
from engine.core.rpc.process import EngineProcessArgs, EngineSettings, run_engine_core_process

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


async def join_process(process: BaseProcess, timeout: float | None) -> None:
    """``process.join(timeout)`` without blocking the event loop.

    Polls instead of using a worker thread: at interpreter exit (an ``LLM`` stopped by its
    finalizer) no new executor threads can be started.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while process.is_alive():  # is_alive() also reaps an exited process
        if deadline is not None and time.monotonic() >= deadline:
            return
        await asyncio.sleep(0.01)


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
    await join_process(process, 5)
    hint = ""
    if process.exitcode == 1:  # died before its own error handling: while importing
        hint = (" or could report an error; its traceback is on stderr above. If it says "
                "'An attempt has been made to start a new process before the current process "
                "has finished its bootstrapping phase': EngineCore's process is started with "
                "'spawn', which imports your script again, so create the LLM under "
                "`if __name__ == \"__main__\":` (or pass in_process=True)")
    raise EngineDeadError(f"EngineCore exited ({describe_exit(process.exitcode)}) before it "
                          f"was ready{hint}")


class EngineLaunch:
    """One spawned EngineCore process, from spawn until a client owns it (module docstring).

    Attributes:
        process: The EngineCore process.
        address: Where it will listen (``unix:PATH`` or ``host:port``).
        secret: The per-launch secret (TCP), None for the unix socket.
        socket_dir: The per-launch 0700 directory of the unix socket, None for TCP.
    """

    def __init__(self, process: BaseProcess, ready: Connection, settings: Connection,
                 address: str, secret: str | None, socket_dir: str | None) -> None:
        self.process = process
        self.address, self.secret, self.socket_dir = address, secret, socket_dir
        self._ready, self._settings = ready, settings
        self._finalizer = weakref.finalize(self, reap, process, socket_dir)

    @classmethod
    def spawn(cls, config: EngineConfig, *, engine_address: str | None = None,
              log_level: int | None = None) -> EngineLaunch:
        """Start the EngineCore process for ``config`` now (returns at once).

        Args:
            config: The engine configuration (sent as JSON).
            engine_address: ``host:port`` for TCP with a secret; None: a private unix socket.
            log_level: Level of the process's ``engine`` loggers (default: this process's).

        Raises:
            ValidationError: ``config`` selects a plugin class given as an object that the
                new process cannot import (defined in ``__main__`` or a function).
        """
        check_no_local_classes(config.plugin_selections())
        address, secret, socket_dir = channel_args(engine_address)
        level = logging.getLogger("engine").getEffectiveLevel() if log_level is None \
            else log_level
        args = EngineProcessArgs(config_json=config.model_dump_json(), address=address,
                                 secret=secret, socket_dir=socket_dir, log_level=level)
        context = multiprocessing.get_context("spawn")
        ready_reader, ready_writer = context.Pipe(duplex=False)
        settings_reader, settings_writer = context.Pipe(duplex=False)
        process = context.Process(target=run_engine_core_process,
                                  args=(args, ready_writer, settings_reader),
                                  name="EngineCore", daemon=False)  # daemons cannot fork
        # its weights and KV cache on huge pages, its idle threads yielding (see the modules)
        with huge_page_malloc(), yielding_waits():
            process.start()
        ready_writer.close()
        settings_reader.close()
        return cls(process, ready_reader, settings_writer, address, secret, socket_dir)

    def send_settings(self, manifest: PluginManifest, eos_token_id: int | None) -> None:
        """Hand the process what the front end resolved; it builds EngineCore from it."""
        settings = EngineSettings(manifest_json=manifest.to_json(), eos_token_id=eos_token_id)
        with contextlib.suppress(OSError):  # it already died: wait_ready() says why
            self._settings.send_bytes(settings.to_json().encode())
        self._settings.close()

    async def wait_ready(self, timeout: float) -> str:
        """The address to connect to, once the process is ready.

        Raises:
            EngineDeadError: with the process's start-up error, its exit status, or the
                timeout.
        """
        try:
            return client_address(await wait_ready(self._ready, self.process, timeout))
        finally:
            self._ready.close()

    def detach(self) -> None:
        """A client took the process over: no more killing it at garbage collection."""
        self._finalizer.detach()

    def cancel(self) -> None:
        """Kill and reap the process, remove the socket directory; idempotent."""
        self._finalizer()
        for conn in (self._ready, self._settings):
            conn.close()


def reap(process: BaseProcess, socket_dir: str | None) -> None:
    """Last resort (garbage collection or interpreter exit without ``shutdown()``)."""
    if process.is_alive():
        process.kill()
    process.join(5)
    if socket_dir:
        shutil.rmtree(socket_dir, ignore_errors=True)
