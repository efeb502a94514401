"""acme_generate, attached to a bare FastAPI app with a stand-in engine client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from acme_engine_plugins.endpoint import SimpleGenerateEndpoint

from engine.sdk import SamplingParams


class FakeClient:
    """What the plugin uses of the engine client: ``generate(request_id, prompt, params)``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, SamplingParams]] = []

    async def generate(self, request_id: str, prompt: str,
                       params: SamplingParams) -> AsyncIterator[Any]:
        self.calls.append((prompt, params))
        for text in ("he", "hello"):  # cumulative outputs, the last one finished
            done = text == "hello"
            yield SimpleNamespace(outputs=[SimpleNamespace(
                text=text, token_ids=list(range(len(text))),
                finish_reason="length" if done else None)])


@pytest.fixture
def app_and_client() -> tuple[Any, FakeClient, SimpleGenerateEndpoint]:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    app = FastAPI()
    plugin = SimpleGenerateEndpoint()
    plugin.attach_router(app)
    return TestClient(app), FakeClient(), plugin


def test_503_until_ready_then_generates(
    app_and_client: tuple[Any, FakeClient, SimpleGenerateEndpoint],
) -> None:
    http, engine, plugin = app_and_client
    assert http.post("/acme/v1/generate", json={"prompt": "hi"}).status_code == 503
    asyncio.run(plugin.init_state(engine, state=None))
    response = http.post("/acme/v1/generate", json={"prompt": "hi", "max_tokens": 5})
    assert response.status_code == 200
    assert response.json() == {"text": "hello", "token_ids": [0, 1, 2, 3, 4],
                               "finish_reason": "length"}
    [(prompt, params)] = engine.calls
    assert prompt == "hi" and params.max_tokens == 5 and params.temperature == 0


@pytest.mark.parametrize("body", [{}, {"prompt": ""}, {"prompt": "x", "max_tokens": 0},
                                  {"prompt": "x", "temperature": -1}])
def test_bad_bodies_are_400s(app_and_client: tuple[Any, FakeClient, SimpleGenerateEndpoint],
                             body: dict[str, Any]) -> None:
    http, engine, plugin = app_and_client
    asyncio.run(plugin.init_state(engine, state=None))
    response = http.post("/acme/v1/generate", json=body)
    assert response.status_code == 400 and "error" in response.json()
    assert engine.calls == []
