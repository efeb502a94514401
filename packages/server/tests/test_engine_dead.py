"""When EngineCore dies: 503 on /health and for new requests, in-flight requests end with an
error (a 503, or an error frame then [DONE] mid-stream), nothing hangs.

The app runs in this process (httpx's ASGI transport) with an in-process EngineCore whose
``step`` starts raising on demand.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.core.client.async_llm import AsyncLLM
from engine.core.client.in_process import InProcessCoreClient
from engine.core.config import EngineConfig
from engine.core.engine.engine_core import EngineCore
from engine.core.startup import EngineSetup
from engine.server.app import build_app
from engine.server.state import ServerArgs
from engine.server.streaming import ChoiceCursor


class _Fuse:
    """Makes EngineCore.step raise once ``steps_left`` reaches 0 (and, when ``after`` is
    set, once ``after`` is set too: the step waits for it, so the death cannot come before
    what the test needs to have happened)."""

    def __init__(self) -> None:
        self.steps_left: int | None = None
        self.after: threading.Event | None = None

    def core_factory(self, setup: EngineSetup, eos_token_id: int | None) -> EngineCore:
        core = EngineCore(setup, eos_token_id=eos_token_id)
        step = core.step

        def fragile_step() -> Any:
            if self.steps_left is not None:
                if self.steps_left <= 0:
                    if self.after is not None:
                        assert self.after.wait(timeout=30), "the fuse waited in vain"
                    raise RuntimeError("boom: the GPU fell off")
                self.steps_left -= 1
            return step()

        core.step = fragile_step  # type: ignore[method-assign]
        return core


@pytest.fixture
async def app_client(tiny_llama_checkpoint: Path) -> AsyncIterator[tuple[httpx.AsyncClient,
                                                                         _Fuse]]:
    fuse = _Fuse()
    config = EngineConfig(model=str(tiny_llama_checkpoint), dtype="float32", num_kv_blocks=64,
                          plugins="none")

    def client_factory(setup: EngineSetup, eos: int | None) -> InProcessCoreClient:
        return InProcessCoreClient(setup, eos_token_id=eos, core_factory=fuse.core_factory)

    engine = AsyncLLM(config, client=client_factory, log_stats=False)
    app = build_app(engine, ServerArgs(served_model_names=("tiny",)))
    await engine.start()
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        yield http, fuse
    await engine.shutdown()


BODY = {"model": "tiny", "prompt": "Hello", "max_tokens": 40, "temperature": 0,
        "ignore_eos": True}


async def test_death_mid_stream_gives_error_frame_then_done(
        app_client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    http, fuse = app_client
    assert (await http.get("/health")).status_code == 200
    # The engine dies only once the stream has a token to send (a death before the stream
    # first looks would end it with the error alone).
    fuse.after = token_sent = threading.Event()
    advance = ChoiceCursor.advance

    def advance_and_tell(self: ChoiceCursor, choice: Any) -> Any:
        delta = advance(self, choice)
        if delta is not None and delta.token_ids:
            token_sent.set()
        return delta

    monkeypatch.setattr(ChoiceCursor, "advance", advance_and_tell)
    fuse.steps_left = 5
    response = await asyncio.wait_for(
        http.post("/v1/completions", json={**BODY, "stream": True}), timeout=30)
    assert response.status_code == 200
    frames = [line.removeprefix("data: ") for line in response.text.splitlines()
              if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    error = json.loads(frames[-2])["error"]
    assert error["code"] == "engine_unavailable" and "boom" in error["message"]
    assert any("choices" in json.loads(frame) for frame in frames[:-2])
    health = await http.get("/health")
    assert health.status_code == 503 and "boom" in health.json()["error"]["message"]
    later = await http.post("/v1/completions", json=BODY)
    assert later.status_code == 503
    assert later.json()["error"]["type"] == "server_error"
    assert (await http.get("/metrics")).status_code == 200


async def test_death_fails_in_flight_non_streaming_requests(app_client: Any) -> None:
    http, fuse = app_client
    fuse.steps_left = 3
    responses = await asyncio.wait_for(asyncio.gather(
        *(http.post("/v1/completions", json=BODY) for _ in range(3)),
        http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 40})), timeout=30)
    assert [r.status_code for r in responses] == [503] * 4
    assert all("boom" in r.json()["error"]["message"] for r in responses)
