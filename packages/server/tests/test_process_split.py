"""``engine serve`` with EngineCore in its own process: same tokens, and death is noticed."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.testing.server import RemoteServer, start_server

PROMPTS = ["Hello there", "The quick brown fox", "1 2 3 4"]


@pytest.fixture(scope="module")
def grpc_server(tiny_llama_checkpoint: Path) -> Iterator[RemoteServer]:
    server = start_server(tiny_llama_checkpoint)
    yield server
    assert server.stop() == 0


def completions(server: RemoteServer) -> list[list[int]]:
    client = server.client()
    results = []
    for i, prompt in enumerate(PROMPTS):
        params = {"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.9, "seed": 42}
        out = client.completions.create(
            model=server.model, prompt=prompt, max_tokens=12,
            extra_body={"ignore_eos": True, "return_token_ids": True}, **params)
        results.append(out.choices[0].token_ids)
    return results


def test_engine_core_runs_in_its_own_process(grpc_server: RemoteServer) -> None:
    assert len(grpc_server.engine_core_pids()) == 1, "no EngineCore child process"


def test_in_process_and_grpc_give_identical_tokens(
    grpc_server: RemoteServer, tiny_llama_checkpoint: Path
) -> None:
    in_process = start_server(tiny_llama_checkpoint, ["--in-process"])
    try:
        assert not in_process.engine_core_pids()
        assert completions(grpc_server) == completions(in_process)
    finally:
        assert in_process.stop() == 0


def test_killing_engine_core_gives_503_within_a_second(tiny_llama_checkpoint: Path) -> None:
    server = start_server(tiny_llama_checkpoint)
    try:
        [core_pid] = server.engine_core_pids()
        os.kill(core_pid, signal.SIGKILL)
        assert server.health_within(503, 1.0) == 503, (
            "the server did not notice EngineCore's death within 1 s")
        response = httpx.post(server.url_for("v1/completions"), timeout=5, json={
            "model": server.model, "prompt": "hi", "max_tokens": 2})
        assert response.status_code == 503
        assert response.json()["error"]["message"]
    finally:
        server.stop()
    assert server.process.returncode is not None
