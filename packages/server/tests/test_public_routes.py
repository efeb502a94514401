"""Which routes ``--api-key`` covers, ``--public-path``, and the probes ``/ping`` and ``/load``.

With a key, every route needs it except ``/health`` and ``/ping`` and the routes opened
with ``--public-path``. ``/ping`` answers as ``/health`` does (GET and POST, as vLLM's);
``GET /load`` counts the generation requests in flight. The app runs in this process
(httpx's ASGI transport) around an in-process engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from engine.core.client.async_llm import AsyncLLM, in_process_client
from engine.core.config import EngineConfig
from engine.server.app import build_app
from engine.server.state import ServerArgs

in_module_loop = pytest.mark.asyncio(loop_scope="module")

KEY = "routes-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def engine(tiny_llama_checkpoint: Path) -> AsyncLLM:
    config = EngineConfig(model=str(tiny_llama_checkpoint), dtype="float32",
                          num_kv_blocks=64, plugins="none")
    return AsyncLLM(config, client=in_process_client, log_stats=False)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def http(engine: AsyncLLM) -> AsyncIterator[httpx.AsyncClient]:
    app = build_app(engine, ServerArgs(served_model_names=("tiny",), api_key=KEY,
                                       public_paths=("/metrics",)))
    await engine.start()
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client
    await engine.shutdown()


CLOSED = [("POST", "/tokenize", {"prompt": "Hi"}), ("POST", "/detokenize", {"tokens": [72]}),
          ("GET", "/docs", None), ("GET", "/openapi.json", None), ("GET", "/load", None),
          ("GET", "/version", None), ("GET", "/v1/models", None),
          ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1})]


@in_module_loop
@pytest.mark.parametrize(("method", "path", "body"), CLOSED, ids=[p for _, p, _ in CLOSED])
async def test_routes_need_the_key(http: httpx.AsyncClient, method: str, path: str,
                                   body: object) -> None:
    refused = await http.request(method, path, json=body)
    assert refused.status_code == 401
    error = refused.json()["error"]
    assert error["code"] == "invalid_api_key" and "/health, /ping" in error["message"]
    wrong = await http.request(method, path, json=body, headers={"Authorization": "Bearer no"})
    assert wrong.status_code == 401
    assert (await http.request(method, path, json=body, headers=AUTH)).status_code == 200


@in_module_loop
@pytest.mark.parametrize(("method", "path"), [("GET", "/health"), ("GET", "/ping"),
                                              ("POST", "/ping"), ("GET", "/metrics")])
async def test_probes_and_public_paths_are_open(http: httpx.AsyncClient, method: str,
                                                path: str) -> None:
    response = await http.request(method, path)
    assert response.status_code == 200, response.text
    if path == "/metrics":
        assert "engine:num_requests_running" in response.text


@in_module_loop
async def test_load_counts_generation_requests_in_flight(
        http: httpx.AsyncClient, engine: AsyncLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    assert (await http.get("/load", headers=AUTH)).json() == {"server_load": 0}
    gate = asyncio.Event()  # holds both requests in flight until /load has been read
    add_request = engine.add_request_async

    async def held(*args: object, **kwargs: object) -> object:
        await gate.wait()
        return await add_request(*args, **kwargs)

    monkeypatch.setattr(engine, "add_request_async", held)
    body = {"prompt": "Hello", "max_tokens": 16, "ignore_eos": True, "temperature": 0}
    requests = [asyncio.ensure_future(http.post("/v1/completions", json=body, headers=AUTH))
                for _ in range(2)]
    load = 0
    for _ in range(1000):  # both arrive and wait at the gate (bounded: a miscount fails)
        await asyncio.sleep(0)
        load = (await http.get("/load", headers=AUTH)).json()["server_load"]
        if load == 2 or any(r.done() for r in requests):
            break
    gate.set()
    assert load == 2, "both requests should count while they run"
    assert [r.status_code for r in await asyncio.gather(*requests)] == [200, 200]
    assert (await http.get("/load", headers=AUTH)).json() == {"server_load": 0}
    await http.post("/tokenize", json={"prompt": "Hi"}, headers=AUTH)  # not a generation
    assert (await http.get("/load", headers=AUTH)).json() == {"server_load": 0}


def test_public_path_that_no_route_serves_is_refused(engine: AsyncLLM) -> None:
    with pytest.raises(ValueError, match=r"--public-path /metric: no route has this path.*"
                                         r"/health.*/tokenize"):
        build_app(engine, ServerArgs(api_key=KEY, public_paths=("/metric",)))


def test_public_path_template_opens_matching_paths() -> None:
    from engine.server.access import APIKeyMiddleware

    async def app(scope: object, receive: object, send: object) -> None:
        raise AssertionError("not called")

    middleware = APIKeyMiddleware(app, KEY, ("/items/{name}",))
    assert middleware.is_public("/items/abc") and middleware.is_public("/ping")
    assert not middleware.is_public("/items/abc/more") and not middleware.is_public("/items")


def test_public_path_flag_must_be_a_path(capsys: pytest.CaptureFixture[str]) -> None:
    from engine.server.cli._main import build_parser

    args = build_parser().parse_args(["serve", "--public-path", "/metrics",
                                      "--public-path", "/docs"])
    assert args.public_path == ["/metrics", "/docs"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--public-path", "metrics"])
    assert "a route path starting with '/'" in capsys.readouterr().err
