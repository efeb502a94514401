"""A real ``engine serve`` subprocess for tests (like vLLM's ``RemoteOpenAIServer``).

Example::

    with running_server(checkpoint, ["--api-key", "k"]) as server:
        client = server.client(api_key="k")
        client.completions.create(model=server.model, prompt="Hi", max_tokens=4)

The server listens on a free port of 127.0.0.1 and writes its log to a file (shown when it
fails to start). At the end it gets SIGTERM, must exit within ``stop_timeout`` seconds,
and its exit status is checked (0 after a graceful shutdown).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Flags every test server gets: small, exact, fast to start.
DEFAULT_SERVER_ARGS = ("--dtype", "float32", "--num-kv-blocks", "128")


def free_port() -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class RemoteServer:
    """A running ``engine serve`` process.

    Attributes:
        base_url: ``http://127.0.0.1:PORT``.
        model: The model name clients pass (the served name, or the checkpoint path).
        process: The server process.
        log_path: Where its stdout and stderr go.
        api_key: The ``--api-key`` it requires, if any (the clients below send it).
    """

    base_url: str
    model: str
    process: subprocess.Popen[bytes]
    log_path: Path
    api_key: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        """HTTP headers that pass the API-key check."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def url_for(self, *parts: str) -> str:
        """``base_url`` joined with ``parts``."""
        return "/".join([self.base_url, *(p.strip("/") for p in parts)])

    def child_pids(self) -> list[int]:
        """Pids of the server's child processes (the EngineCore process, unless in-process)."""
        children: list[int] = []
        for task in Path(f"/proc/{self.process.pid}/task").glob("*"):
            with contextlib.suppress(OSError):
                children += [int(p) for p in (task / "children").read_text().split()]
        return children

    def engine_core_pids(self) -> list[int]:
        """Pids of spawned EngineCore processes (children started by ``spawn_main``)."""
        pids = []
        for pid in self.child_pids():
            with contextlib.suppress(OSError):
                if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    pids.append(pid)
        return pids

    def health_within(self, status: int, seconds: float) -> int:
        """Poll ``GET /health`` until it answers ``status`` or ``seconds`` pass; the last."""
        import httpx

        start = time.monotonic()
        last = -1
        while time.monotonic() - start < seconds:
            with contextlib.suppress(httpx.HTTPError):
                last = httpx.get(self.url_for("health"), timeout=1).status_code
                if last == status:
                    break
            time.sleep(0.05)
        return last

    def log(self) -> str:
        """The server's log so far."""
        return self.log_path.read_text(errors="replace")

    def client(self, api_key: str | None = None, **kwargs: Any) -> Any:
        """An ``openai.OpenAI`` client for this server (with its API key by default)."""
        import openai

        return openai.OpenAI(base_url=self.url_for("v1"),
                             api_key=api_key or self.api_key or "EMPTY", max_retries=0,
                             **kwargs)

    def async_client(self, api_key: str | None = None, **kwargs: Any) -> Any:
        """An ``openai.AsyncOpenAI`` client for this server (with its API key by default)."""
        import openai

        return openai.AsyncOpenAI(base_url=self.url_for("v1"),
                                  api_key=api_key or self.api_key or "EMPTY", max_retries=0,
                                  **kwargs)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait up to ``timeout`` s (then SIGKILL); returns the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
                raise AssertionError(f"engine serve did not exit within {timeout} s of "
                                     f"SIGTERM; log:\n{self.log()[-4000:]}") from None
        return self.process.returncode


def start_server(model: str | os.PathLike[str], args: Sequence[str] = (), *,
                 env: Mapping[str, str] | None = None, served_model_name: str | None = None,
                 api_key: str | None = None, startup_timeout: float = 180.0,
                 log_dir: Path | None = None,
                 base_args: Sequence[str] = DEFAULT_SERVER_ARGS) -> RemoteServer:
    """Start ``engine serve MODEL`` with ``base_args`` + ``args``; wait for /health.

    ``served_model_name`` and ``api_key`` add the flags and are remembered by the returned
    :class:`RemoteServer` (its clients use them). ``base_args`` defaults to the small test
    settings of ``DEFAULT_SERVER_ARGS`` (128 KV blocks); pass ``()`` to get the engine's
    own defaults (benchmarks).

    Raises:
        RuntimeError: the server exited or did not become healthy in time (with its log).
    """
    import httpx

    port = free_port()
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="engine-serve-"))
    log_path = log_dir / f"engine-serve-{port}.log"
    extra = ["--served-model-name", served_model_name] if served_model_name else []
    extra += ["--api-key", api_key] if api_key else []
    command = [sys.executable, "-m", "engine.server.cli", "serve", str(model),
               "--port", str(port), *base_args, *extra, *args]
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT,
                                   env=dict(env) if env is not None else None)
    server = RemoteServer(f"http://127.0.0.1:{port}", served_model_name or str(model),
                          process, log_path, api_key)
    deadline = time.monotonic() + startup_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"engine serve exited with status {process.returncode} "
                               f"during start-up; log:\n{server.log()[-4000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(server.url_for("health"), timeout=2).status_code == 200:
                return server
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"engine serve was not healthy after {startup_timeout} s; log:\n"
                       f"{server.log()[-4000:]}")


@contextlib.contextmanager
def running_server(model: str | os.PathLike[str], args: Sequence[str] = (),
                   **kwargs: Any) -> Iterator[RemoteServer]:
    """:func:`start_server`, then stop it at exit and check it exited cleanly (status 0)."""
    server = start_server(model, args, **kwargs)
    try:
        yield server
    finally:
        status = server.stop()
    assert status == 0, f"engine serve exited with status {status}; log:\n{server.log()[-4000:]}"
