"""``POST /pooling``: the ``--io-processor`` behind vLLM's route (the ``io`` test plugins).

One real ``engine serve --io-processor test_io_prompts`` serves the round trip and the
errors; the 404 without ``--io-processor`` and the API-key check need no engine running
(the app is built around an engine that was never started).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.core.client.async_llm import AsyncLLM
from engine.core.config import EngineConfig
from engine.server.app import build_app
from engine.server.state import ServerArgs
from engine.testing.server import RemoteServer, running_server
from engine.testing.test_plugins import env_with_plugins

IO = "engine-test-plugin-io"


@pytest.fixture(scope="module")
def io_server(tiny_llama_checkpoint: Path, test_plugins_dir: Path) -> Iterator[RemoteServer]:
    args = ["--in-process", "--plugins", IO, "--io-processor", "test_io_prompts",
            "--plugin-option", "test_io_prompts.max_prompts=3"]
    with running_server(tiny_llama_checkpoint, args, served_model_name="tiny",
                        env=env_with_plugins(test_plugins_dir)) as remote:
        yield remote


def _pool(server: RemoteServer, body: Any) -> httpx.Response:
    return httpx.post(server.url_for("pooling"), json=body, timeout=60)


def test_the_body_goes_through_the_processor_and_the_engine(io_server: RemoteServer) -> None:
    response = _pool(io_server, {"prompts": ["Hello", [72, 105]], "max_tokens": 5})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["processor"] == "test_io_prompts" and body["request_id"].startswith("pool-")
    assert [r["request_id"] for r in body["results"]] == [
        f"{body['request_id']}-0", f"{body['request_id']}-1"]
    assert all(r["finish_reason"] == "length" and len(r["token_ids"]) == 5
               for r in body["results"])
    # Each prompt was generated with the processor's own (greedy) params: the completions
    # route, which the processor never touches, gives the same tokens.
    completion = io_server.client().completions.create(
        model="tiny", prompt="Hello", max_tokens=5, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    assert completion.choices[0].text == body["results"][0]["text"]
    assert completion.choices[0].model_extra["token_ids"] == body["results"][0]["token_ids"]


def test_requests_run_concurrently(io_server: RemoteServer) -> None:
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return list(await asyncio.gather(*(
                client.post(io_server.url_for("pooling"), json={"prompts": [f"Hi {i}"]})
                for i in range(4))))

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * 4
    assert len({r.json()["request_id"] for r in responses}) == 4


@pytest.mark.parametrize(("body", "param"), [
    ({"prompts": []}, "prompts"),
    ({"prompts": ["a", "b", "c", "d"]}, "prompts"),  # --plugin-option max_prompts=3
    ({"prompts": ["a", {"x": 1}]}, "prompts[1]"),
    ({"prompts": ["a"], "max_tokens": 100}, "max_tokens"),
    ({"prompts": [[10**6]]}, "prompt"),  # the engine refuses the prompt the processor made
])
def test_validation_errors_are_400_naming_the_field(io_server: RemoteServer, body: Any,
                                                    param: str) -> None:
    response = _pool(io_server, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_a_malformed_body_is_400(io_server: RemoteServer) -> None:
    response = httpx.post(io_server.url_for("pooling"), content=b"{not json", timeout=30)
    assert response.status_code == 400
    assert "malformed JSON body" in response.json()["error"]["message"]


@pytest.mark.parametrize(("misbehave", "cause"), [
    ("raise_in_parse", "parse_request raised RuntimeError"),
    ("raise_in_pre", "pre_process raised RuntimeError"),
    ("raise_in_post", "post_process raised RuntimeError"),
    ("no_prompts", "pre_process must return a non-empty sequence"),
    ("n_2", "prompt 0 of pre_process asks for n=2"),
    ("not_json", "post_process returned a body JSON cannot encode"),
])
def test_a_failing_processor_is_a_500_plugin_error_for_that_request_only(
        io_server: RemoteServer, misbehave: str, cause: str) -> None:
    response = _pool(io_server, {"prompts": ["Hello"], "misbehave": misbehave})
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "plugin_error")
    assert error["message"].startswith(
        f"plugin 'test_io_prompts' (group engine.io_processors, distribution {IO} 0.1.0): "
        f"{cause}")
    assert httpx.get(io_server.url_for("health")).status_code == 200
    assert _pool(io_server, {"prompts": ["Hello"]}).status_code == 200


def _unstarted_app(checkpoint: Path, **server_args: Any) -> Any:
    engine = AsyncLLM(EngineConfig(model=str(checkpoint), dtype="float32", plugins="none"))
    return build_app(engine, ServerArgs(**server_args))


async def test_without_io_processor_pooling_is_404_saying_how(tiny_llama_checkpoint: Path,
                                                              ) -> None:
    app = _unstarted_app(tiny_llama_checkpoint)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://test") as client:
        response = await client.post("/pooling", json={"prompts": ["Hello"]})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "io_processor_not_enabled"
    assert "engine serve --io-processor NAME" in error["message"]


async def test_the_api_key_protects_pooling(tiny_llama_checkpoint: Path) -> None:
    app = _unstarted_app(tiny_llama_checkpoint, api_key="k")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://test") as client:
        refused = await client.post("/pooling", json={})
        allowed = await client.post("/pooling", json={}, headers={"Authorization": "Bearer k"})
    assert refused.status_code == 401
    assert allowed.status_code == 404  # past the key check; no IO processor selected
