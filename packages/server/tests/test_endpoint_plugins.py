"""Endpoint plugins (opt-in routes) and plugin parameters through the HTTP API.

The server runs with the installed test distribution ``engine-test-plugin-good`` named in
``--plugins``: its endpoint ``test_good_echo`` adds ``GET /test-echo/{word}`` and its
logits processor ``test_good_ban_token`` reads ``extra_args["ban_token"]``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import APIRouter, FastAPI

from engine.sdk import EndpointPlugin
from engine.sdk.errors import PluginError
from engine.server.endpoints import attach_endpoint, route_keys
from engine.testing.server import RemoteServer, running_server
from engine.testing.test_plugins import env_with_plugins


@pytest.fixture(scope="module")
def plugin_server(tiny_llama_checkpoint: Path, test_plugins_dir: Path
                  ) -> Iterator[RemoteServer]:
    with running_server(tiny_llama_checkpoint, ["--plugins", "engine-test-plugin-good"],
                        served_model_name="tiny", env=env_with_plugins(test_plugins_dir)
                        ) as remote:
        yield remote


def test_endpoint_plugin_route_is_served(plugin_server: RemoteServer) -> None:
    response = httpx.get(plugin_server.url_for("test-echo/hello"))
    assert response.status_code == 200 and response.json() == {"word": "hello"}
    assert "endpoint plugin 'test_good_echo'" in plugin_server.log()


def _first_token(server: RemoteServer, **extra: Any) -> int:
    result = server.client().completions.create(
        model="tiny", prompt="Hello", max_tokens=1, temperature=0,
        extra_body={"return_token_ids": True, **extra})
    token_ids: list[int] = result.choices[0].model_extra["token_ids"]
    return token_ids[0]


def test_vllm_xargs_and_extra_args_reach_the_logits_processor(
        plugin_server: RemoteServer) -> None:
    greedy = _first_token(plugin_server)
    assert _first_token(plugin_server, vllm_xargs={"ban_token": greedy}) != greedy
    assert _first_token(plugin_server, extra_args={"ban_token": greedy}) != greedy
    assert _first_token(plugin_server) == greedy  # other requests are untouched


def test_plugin_parameter_validation_is_a_400(plugin_server: RemoteServer) -> None:
    response = httpx.post(plugin_server.url_for("v1/completions"), json={
        "prompt": "Hello", "max_tokens": 2, "vllm_xargs": {"ban_token": "seven"}})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "extra_args.ban_token" and "token id" in error["message"]


class _Clashing(EndpointPlugin):
    name = "clashing"

    def __init__(self, path: str) -> None:
        self.path = path

    def attach_router(self, app: Any) -> None:
        router = APIRouter()

        @router.get(self.path)
        async def route() -> dict[str, str]:
            return {}

        app.include_router(router)


def _app_with_models_route() -> tuple[FastAPI, dict[tuple[str, str], str]]:
    app = FastAPI()

    @app.get("/v1/models")
    async def list_models() -> dict[str, str]:
        return {}

    owners = {key: f"the built-in route {name!r}"
              for key, name in route_keys(app.router.routes).items()}
    return app, owners


def test_route_clash_with_a_built_in_names_both() -> None:
    app, owners = _app_with_models_route()
    with pytest.raises(PluginError) as info:
        attach_endpoint(app, "clashing", _Clashing("/v1/models"), owners)
    message = str(info.value)
    assert "'clashing'" in message and "GET /v1/models" in message
    assert "built-in route 'list_models'" in message


def test_route_clash_between_plugins_names_both() -> None:
    app, owners = _app_with_models_route()
    attach_endpoint(app, "first", _Clashing("/extra"), owners, "endpoint plugin 'first' (a 1)")
    with pytest.raises(PluginError) as info:
        attach_endpoint(app, "second", _Clashing("/extra"), owners)
    message = str(info.value)
    assert "'second'" in message and "endpoint plugin 'first' (a 1)" in message
