"""The EngineCore process: started with multiprocessing ``spawn`` by ``GrpcCoreClient``.

Life of the process::

    spawn -> watch the parent (exit within ~0.2 s of its death, removing the socket dir)
          -> EngineConfig from JSON; prepare() (imports torch, reads the model's config)
          -> wait for the front end's EngineSettings (manifest, EOS id); manifest.verify()
          -> EngineCore (loads the weights, sizes the KV cache)
          -> gRPC server on the unix socket (or TCP with the secret)
          -> "ready" (or the start-up error) to the parent over the pipe
          -> EngineLoop.run() on the main thread until Shutdown, SIGTERM or an error
          -> stop the server, shut EngineCore down, exit

SIGINT is ignored: Ctrl-C in a terminal reaches the whole process group, and the front end
owns shutting EngineCore down.

This module is imported by the front end to spawn the process, before it has imported
torch itself (``engine serve`` starts EngineCore first thing), so the modules that need
torch or gRPC are imported inside the functions that run in the child.
"""

from __future__ import annotations

import atexit
import json
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from types import FrameType
from typing import TYPE_CHECKING, NoReturn

from engine.core.config import EngineConfig
from engine.core.heap import defer_full_collections, freeze_startup_heap
from engine.core.messages import EngineInfo
from engine.core.plugins import PluginManifest

if TYPE_CHECKING:
    from engine.core.engine.engine_core import EngineCore
    from engine.core.engine.loop import EngineLoop

logger = logging.getLogger("engine.core.rpc")

#: How often the child checks that its parent is still alive.
PARENT_POLL_S = 0.2
#: Seconds in-flight RPCs get to finish once the loop stopped.
STOP_GRACE_S = 1.0
#: Seconds the atexit handlers get before the process ends regardless.
EXIT_DEADLINE_S = 0.5


@dataclass(frozen=True)
class EngineProcessArgs:
    """What the parent hands the EngineCore process at spawn (plain strings; JSON inside).

    Attributes:
        config_json: ``EngineConfig.model_dump_json()``.
        address: ``unix:PATH`` or ``HOST:PORT`` to listen on.
        secret: Required as call metadata on every call (TCP); None for unix sockets.
        socket_dir: The per-launch socket directory, removed if the parent dies.
        log_level: Level for the ``engine`` loggers in this process.
    """

    config_json: str
    address: str
    secret: str | None = None
    socket_dir: str | None = None
    log_level: int = logging.INFO


@dataclass(frozen=True)
class EngineSettings:
    """What the front end resolved after the spawn, sent over the settings pipe.

    Attributes:
        manifest_json: ``PluginManifest.to_json()`` of the front end.
        eos_token_id: The tokenizer's EOS id, for the sampler.
    """

    manifest_json: str
    eos_token_id: int | None

    def to_json(self) -> str:
        """One JSON object."""
        return json.dumps({"manifest": self.manifest_json, "eos_token_id": self.eos_token_id})

    @classmethod
    def receive(cls, conn: Connection) -> EngineSettings:
        """Block until the front end sends its settings.

        Raises:
            RuntimeError: the front end closed the pipe without sending them (it failed).
        """
        try:
            data = json.loads(conn.recv_bytes())
        except EOFError:
            raise RuntimeError("the front end stopped before it sent EngineCore its "
                               "settings") from None
        finally:
            conn.close()
        return cls(manifest_json=data["manifest"], eos_token_id=data["eos_token_id"])


def watch_parent(parent_pid: int, socket_dir: str | None, *, me: str = "EngineCore",
                 parent: str = "the front end") -> None:
    """Exit the process soon after the parent dies (nobody is left to shut us down)."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    logger.error("%s: %s process %d is gone; exiting", me, parent, parent_pid)
    if socket_dir:
        shutil.rmtree(socket_dir, ignore_errors=True)
    exit_process(1)


def describe_error(exc: BaseException) -> str:
    """One line for the parent: the error and its chain of causes."""
    parts: list[str] = []
    seen: BaseException | None = exc
    while seen is not None and len(parts) < 4:
        parts.append(f"{type(seen).__name__}: {seen}")
        seen = seen.__cause__ or seen.__context__
    return " <- caused by ".join(parts)


def send_message(conn: Connection, **message: object) -> None:
    try:
        conn.send_bytes(json.dumps(message).encode())
    except OSError:  # the parent is gone; the watcher ends us
        pass


def run_engine_core_process(args: EngineProcessArgs, ready: Connection,
                            settings: Connection) -> None:
    """Entry point of the spawned process: build, serve, exit.

    Reads one :class:`EngineSettings` from ``settings`` once the model's config is read.
    Sends ``{"ready": address}`` or ``{"error": message}`` over ``ready`` exactly once;
    exits with status 0 after a clean stop, 1 after an error.
    """
    defer_full_collections()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [EngineCore] %(name)s: %(message)s")
    parent = multiprocessing.parent_process()  # its pid as recorded at spawn: no race
    threading.Thread(target=watch_parent,
                     args=(parent.pid if parent else os.getppid(), args.socket_dir),
                     name="engine-core-parent-watch", daemon=True).start()
    executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="engine-core-grpc")
    try:
        from engine.core.engine.loop import EngineLoop
        from engine.core.rpc.server import make_server

        core, info = build_engine_core(args, settings)
        loop = EngineLoop(core)
        server, bound = make_server(loop, info, args.address, secret=args.secret,
                                    executor=executor)
    except BaseException as exc:  # every start-up failure goes to the parent (logged)
        logger.exception("EngineCore failed to start")
        send_message(ready, error=describe_error(exc))
        ready.close()
        executor.shutdown(wait=False)
        exit_process(1)
    signal.signal(signal.SIGTERM, lambda signum, frame: _on_sigterm(loop, signum, frame))
    freeze_startup_heap()
    send_message(ready, ready=bound)
    ready.close()
    logger.info("EngineCore serving on %s", bound)
    exit_code = 0
    try:
        loop.run()
    except BaseException:  # noqa: BLE001 - logged by the loop; exit with a status
        exit_code = 1
    server.stop(STOP_GRACE_S).wait()
    executor.shutdown(wait=False, cancel_futures=True)
    try:
        core.shutdown()
    except Exception:  # exiting anyway (logged)
        logger.exception("EngineCore shutdown failed")
    logger.info("EngineCore stopped")
    exit_process(exit_code)


def exit_process(exit_code: int) -> NoReturn:
    """Run the atexit handlers (multiprocessing finalizers, logging), then end the process.

    Used by EngineCore's process and by ``engine serve`` once everything is stopped.
    Skipping the interpreter's own teardown (a garbage collection over every module's
    objects) saves 1-3 s with torch and transformers loaded, and no non-daemon thread
    (gRPC's pool, a busy executor) can hold the exit up; should a handler hang, the process
    still ends after :data:`EXIT_DEADLINE_S`.
    """
    def deadline() -> None:
        time.sleep(EXIT_DEADLINE_S)
        os._exit(exit_code)
    threading.Thread(target=deadline, name="exit-deadline", daemon=True).start()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def _on_sigterm(loop: EngineLoop, signum: int, frame: FrameType | None) -> None:
    logger.info("EngineCore: SIGTERM, stopping")
    loop.stop()


def build_engine_core(args: EngineProcessArgs, settings: Connection,
                      ) -> tuple[EngineCore, EngineInfo]:
    """``EngineCore`` and ``EngineInfo`` from the parent's config and settings.

    Raises:
        PluginError: this process does not have the front end's plugins.
        RuntimeError: the front end stopped before it sent its settings.
        ValidationError, OSError, ...: the model or the config cannot be used.
    """
    from engine.core.engine.engine_core import EngineCore
    from engine.core.startup import prepare

    config = EngineConfig.model_validate_json(args.config_json)
    setup = prepare(config, process="engine_core")
    received = EngineSettings.receive(settings)
    PluginManifest.from_json(received.manifest_json).verify(setup.catalog,
                                                            process="EngineCore")
    core = EngineCore(setup, eos_token_id=received.eos_token_id)
    return core, core.info()
