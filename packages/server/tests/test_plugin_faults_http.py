"""Over HTTP, a plugin that fails a request is a 500 ``plugin_error`` for that request only.

A real ``engine serve`` (EngineCore in its own process, so the failure crosses the gRPC
boundary) with ``engine-test-plugin-faults``: concurrent requests where one asks the
per-request processor to raise get 200 for the others, a 500 naming the plugin for it,
an error frame when it streams, and the server stays healthy for the next requests.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.testing.server import RemoteServer, running_server
from engine.testing.test_plugins import env_with_plugins

IDENTITY = ("plugin 'test_fault_request' (group engine.logits_processors, distribution "
            "engine-test-plugin-faults 0.1.0)")


@pytest.fixture(scope="module")
def server(tiny_llama_checkpoint: Path, fault_plugins_dir: Path) -> Iterator[RemoteServer]:
    with running_server(tiny_llama_checkpoint, ["--plugins", "engine-test-plugin-faults"],
                        served_model_name="tiny",
                        env=env_with_plugins(fault_plugins_dir)) as remote:
        yield remote


def body(fault: str | None = None, **extra: object) -> dict[str, object]:
    payload: dict[str, object] = {"model": "tiny", "prompt": "Hello there", "max_tokens": 4,
                                  "temperature": 0, "ignore_eos": True, **extra}
    if fault is not None:
        payload["vllm_xargs"] = {"fault": fault}
    return payload


def test_only_the_failing_request_gets_a_500_plugin_error(server: RemoteServer) -> None:
    async def send() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            url = server.url_for("v1", "completions")
            return list(await asyncio.gather(*(
                client.post(url, json=body(fault)) for fault in (None, "apply", "none", None))))

    responses = asyncio.run(send())
    assert [r.status_code for r in responses] == [200, 500, 200, 200], [r.text for r in responses]
    error = responses[1].json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "plugin_error")
    assert error["message"].startswith(f"{IDENTITY}: apply() raised ZeroDivisionError")
    texts = {r.json()["choices"][0]["text"] for i, r in enumerate(responses) if i != 1}
    assert len(texts) == 1  # the same greedy completion, unaffected by the failure
    assert httpx.get(server.url_for("health"), timeout=10).status_code == 200
    again = httpx.post(server.url_for("v1", "completions"), json=body(), timeout=60)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] in texts


def test_a_failing_stream_ends_with_an_error_frame(server: RemoteServer) -> None:
    with httpx.stream("POST", server.url_for("v1", "completions"),
                      json=body("apply", stream=True), timeout=60) as response:
        frames = [line.removeprefix("data: ") for line in response.iter_lines()
                  if line.startswith("data: ")]
    assert response.status_code == 200  # the stream had started
    errors = [json.loads(f)["error"] for f in frames if f != "[DONE]" and "error" in f]
    assert len(errors) == 1 and errors[0]["code"] == "plugin_error"
    assert errors[0]["message"].startswith(IDENTITY)
    assert httpx.get(server.url_for("health"), timeout=10).status_code == 200


def test_chat_completions_fail_the_same_way(server: RemoteServer) -> None:
    response = httpx.post(server.url_for("v1", "chat", "completions"), json={
        "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
        "vllm_xargs": {"fault": "apply"}}, timeout=60)
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "plugin_error"


def test_failed_requests_are_counted_as_error(server: RemoteServer) -> None:
    httpx.post(server.url_for("v1", "completions"), json=body("apply"), timeout=60)
    metrics = httpx.get(server.url_for("metrics"), timeout=10).text
    [line] = [m for m in metrics.splitlines() if m.startswith("engine:request_success_total")
              and 'finished_reason="error"' in m]
    assert float(line.rsplit(" ", 1)[1]) >= 1
