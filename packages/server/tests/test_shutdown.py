"""``engine serve`` keeps its documented contract at shutdown and when EngineCore dies.

* SIGTERM with requests running past ``--graceful-timeout``: a non-streaming client gets a
  503 ``engine_unavailable`` JSON body, a stream an error frame then ``[DONE]``; no
  cancelled-task tracebacks; the process exits (status 0) within a second of the last
  request ending.
* EngineCore killed: ``/metrics`` says the engine is down (``engine:engine_alive 0``, the
  running and KV gauges 0), its series are labelled with the served model name, and the
  server exits with status 1 for its supervisor to restart it.

The checkpoint is the tiny test model with a 4096-token context, so a request with
``max_tokens`` in the thousands runs for seconds.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.core.client.stat_loggers import LoggingStatLogger, StatLoggerSet
from engine.sdk.stat_logger import StatLoggerContext
from engine.sdk.stats import SchedulerStats
from engine.testing.server import RemoteServer, start_server

CONTEXT = 4096
LONG_ARGS = ["--max-model-len", str(CONTEXT), "--num-kv-blocks", str(2 * CONTEXT // 16 + 8)]
LONG_BODY = {"model": "tiny", "prompt": "Hello", "max_tokens": CONTEXT - 16,
             "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def long_checkpoint(tiny_llama_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory,
                    ) -> Path:
    """The tiny checkpoint with room for long generations."""
    path = tmp_path_factory.mktemp("long") / "llama"
    shutil.copytree(tiny_llama_checkpoint, path)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (path / "config.json").write_text(json.dumps(config))
    return path


def start(checkpoint: Path, *args: str) -> RemoteServer:
    return start_server(checkpoint, [*LONG_ARGS, *args], served_model_name="tiny",
                        env=dict(os.environ, ENGINE_PLUGINS="none"))


def metric(server: RemoteServer, name: str) -> float:
    text = httpx.get(server.url_for("metrics"), timeout=5).text
    [value] = [line.rsplit(" ", 1)[1] for line in text.splitlines()
               if line.startswith(f'{name}{{model_name="tiny"}}')]
    return float(value)


def wait_running(server: RemoteServer, count: int) -> None:
    deadline = time.monotonic() + 30
    while metric(server, "engine:num_requests_running") < count:
        assert time.monotonic() < deadline, "the requests did not start running"
        time.sleep(0.05)


class Client(threading.Thread):
    """One request on its own thread; ``result`` and ``ended`` (monotonic) when done."""

    def __init__(self, server: RemoteServer, stream: bool) -> None:
        super().__init__(daemon=True)
        self.server, self.stream = server, stream
        self.result: Any = None
        self.ended = 0.0

    def run(self) -> None:
        url = self.server.url_for("v1/completions")
        try:
            if self.stream:
                with httpx.stream("POST", url, json={**LONG_BODY, "stream": True},
                                  timeout=60) as response:
                    self.result = [line.removeprefix("data: ")
                                   for line in response.iter_lines() if line]
            else:
                self.result = httpx.post(url, json=LONG_BODY, timeout=60)
        except httpx.HTTPError as exc:
            self.result = exc
        self.ended = time.monotonic()


def test_sigterm_ends_running_requests_with_the_documented_error(long_checkpoint: Path,
                                                                 ) -> None:
    server = start(long_checkpoint, "--graceful-timeout", "1")
    try:
        clients = [Client(server, stream=False), Client(server, stream=True)]
        for client in clients:
            client.start()
        wait_running(server, 2)
        server.process.send_signal(signal.SIGTERM)
        for client in clients:
            client.join(30)
        server.process.wait(30)
        exited = time.monotonic()
    finally:
        server.stop()
    plain, stream = clients

    assert isinstance(plain.result, httpx.Response), plain.result
    assert plain.result.status_code == 503
    assert plain.result.headers["content-type"] == "application/json"
    error = plain.result.json()["error"]
    assert error["code"] == "engine_unavailable" and error["type"] == "server_error"
    assert "--graceful-timeout of 1 s" in error["message"], error

    assert isinstance(stream.result, list), stream.result
    frames = stream.result
    assert frames[-1] == "[DONE]"
    assert json.loads(frames[-2])["error"]["code"] == "engine_unavailable"
    assert any(json.loads(frame).get("choices") for frame in frames[:-2]), "no token came"

    assert server.process.returncode == 0
    last_end = max(client.ended for client in clients)
    assert exited - last_end < 1.0, (
        f"the process exited {exited - last_end:.2f} s after the last request ended")
    log = server.log()
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]


@pytest.fixture(scope="module")
def dead_server(long_checkpoint: Path) -> Iterator[tuple[RemoteServer, Client, str, str]]:
    """A server whose EngineCore was killed while it ran a request; /metrics before, after."""
    server = start(long_checkpoint)
    try:
        client = Client(server, stream=False)
        client.start()
        wait_running(server, 1)
        before = httpx.get(server.url_for("metrics"), timeout=5).text
        [core] = server.engine_core_pids()
        os.kill(core, signal.SIGKILL)
        assert server.health_within(503, 5.0) == 503
        after = httpx.get(server.url_for("metrics"), timeout=5).text
        client.join(30)
        yield server, client, before, after
    finally:
        server.stop()


def values(metrics_text: str, name: str) -> list[float]:
    return [float(line.rsplit(" ", 1)[1]) for line in metrics_text.splitlines()
            if line.startswith(name + "{")]


def test_metrics_say_the_engine_is_down(dead_server: Any) -> None:
    _, _, before, after = dead_server
    assert values(before, "engine:engine_alive") == [1.0]
    assert values(before, "engine:num_requests_running") == [1.0]
    assert values(before, "engine:kv_cache_usage_perc")[0] > 0
    assert values(after, "engine:engine_alive") == [0.0]
    assert values(after, "engine:num_requests_running") == [0.0]
    assert values(after, "engine:num_requests_waiting") == [0.0]
    assert values(after, "engine:kv_cache_usage_perc") == [0.0]


def test_metrics_are_labelled_with_the_served_model_name(dead_server: Any,
                                                         long_checkpoint: Path) -> None:
    _, _, before, _ = dead_server
    series = [line for line in before.splitlines()
              if line.startswith("engine:") and "{" in line]
    assert series and all('model_name="tiny"' in line for line in series), series[:5]
    assert str(long_checkpoint) not in before


def test_engine_serve_exits_with_status_1_after_engine_core_died(dead_server: Any) -> None:
    server, client, _, _ = dead_server
    assert client.result.status_code == 503
    assert client.result.json()["error"]["code"] == "engine_unavailable"
    assert "SIGKILL" in client.result.json()["error"]["message"]
    assert server.process.wait(30) == 1
    assert "exits with status 1" in server.log()


def test_the_periodic_log_says_the_engine_is_dead(caplog: pytest.LogCaptureFixture) -> None:
    ctx = StatLoggerContext(model="tiny", max_model_len=256, num_kv_blocks=8, block_size=16)
    loggers = StatLoggerSet([("logging", LoggingStatLogger(ctx))])
    loggers.record(SchedulerStats(num_running_reqs=16, kv_cache_usage=0.5), None)
    with caplog.at_level(logging.INFO, logger="engine.stats"):
        loggers.log()
        assert "Running: 16 reqs" in caplog.text
        caplog.clear()
        loggers.mark_engine_dead(RuntimeError("the EngineCore process ended: SIGKILL"))
        loggers.log()
    assert "Running:" not in caplog.text
    assert "Engine is dead" in caplog.text and "SIGKILL" in caplog.text
