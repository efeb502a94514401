"""``engine serve`` with worker processes: TP=2 tokens, POST /collective_rpc, worker death."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.core import LLM, SamplingParams
from engine.testing.server import RemoteServer, running_server, start_server
from engine.testing.test_plugins import env_with_plugins

KEY = "dev-key"
PROMPTS = ["Hello there", "The quick brown fox", "1 2 3 4"]


@pytest.fixture(scope="module")
def tp2_server(tiny_llama_checkpoint: Path, test_plugins_dir: Path) -> Iterator[RemoteServer]:
    env = env_with_plugins(test_plugins_dir, {"ENGINE_PLUGINS": "engine-test-plugin-workers"})
    args = ["--tensor-parallel-size", "2", "--worker-extension", "test_inspect",
            "--enable-dev-endpoints"]
    with running_server(tiny_llama_checkpoint, args, env=env, api_key=KEY) as server:
        yield server


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            for child in (task / "children").read_text().split():
                found += [int(child), *descendants(int(child))]
    return found


def worker_pids(server: RemoteServer) -> list[int]:
    [core] = server.engine_core_pids()
    return [pid for pid in descendants(core)
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def greedy_tokens(server: RemoteServer) -> list[list[int]]:
    client = server.client()
    return [client.completions.create(
        model=server.model, prompt=prompt, max_tokens=10, temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0].token_ids
        for prompt in PROMPTS]


def test_tp2_server_gives_tp1_tokens(tp2_server: RemoteServer,
                                     tiny_llama_checkpoint: Path) -> None:
    assert len(worker_pids(tp2_server)) == 2
    with LLM(str(tiny_llama_checkpoint), dtype="float32", plugins="none",
             in_process=True) as llm:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=10,
                                                       ignore_eos=True), use_tqdm=False)
    assert greedy_tokens(tp2_server) == [list(o.outputs[0].token_ids) for o in outputs]


def test_collective_rpc_endpoint_reaches_every_rank_behind_the_api_key(
        tp2_server: RemoteServer) -> None:
    url = tp2_server.url_for("collective_rpc")
    assert httpx.post(url, json={"method": "worker_info"}).status_code == 401
    response = httpx.post(url, json={"method": "worker_info"}, headers=tp2_server.headers)
    assert response.status_code == 200, response.text
    assert [r["rank"] for r in response.json()["results"]] == [0, 1]
    failed = httpx.post(url, json={"method": "fail", "args": ["on purpose"]},
                        headers=tp2_server.headers)
    assert failed.status_code == 400
    message = failed.json()["error"]["message"]
    assert "rank 0" in message and "engine-test-plugin-workers" in message, message
    assert "on purpose" in message
    assert httpx.get(tp2_server.url_for("health")).status_code == 200  # still serving


def test_killed_worker_gives_503_naming_the_rank(tiny_llama_checkpoint: Path) -> None:
    env = dict(os.environ, ENGINE_PLUGINS="none")
    server = start_server(tiny_llama_checkpoint, ["--distributed-executor-backend", "mp"],
                          env=env)
    try:
        assert httpx.post(server.url_for("collective_rpc"),
                          json={"method": "x"}).status_code == 404  # dev endpoints are off
        [worker] = worker_pids(server)
        core = server.engine_core_pids()
        result: dict[str, Any] = {}

        def long_request() -> None:
            result["response"] = httpx.post(server.url_for("v1/completions"), timeout=30, json={
                "model": server.model, "prompt": "hi", "max_tokens": 200, "ignore_eos": True})

        thread = threading.Thread(target=long_request)
        thread.start()
        time.sleep(0.3)  # the request is being generated
        os.kill(worker, signal.SIGKILL)
        assert server.health_within(503, 1.0) == 503, (
            "the server did not notice the worker's death within 1 s")
        thread.join(10)
        response = result["response"]
        assert response.status_code == 503
        assert "worker rank 0" in response.json()["error"]["message"]
        assert "killed by SIGKILL" in response.json()["error"]["message"]
    finally:
        server.stop()
    for pid in [worker, *core]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
