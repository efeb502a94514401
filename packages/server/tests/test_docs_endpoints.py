"""docs/plugins/endpoints.md: its endpoints pass their tests and are served.

The page's modules are written to a temporary ``acme_plugins`` package and installed as
the ``engine.endpoints`` entries its "Registering" section shows; its tests run as
written. A server app, with the endpoint named in the allowlist as "Selecting and
configuring" says, serves the readiness probe (503 before its lifespan started the
engine, 200 after) and the route that generates through the engine client (the same
tokens as ``AsyncLLM.generate``, 400 for a bad request, 503 once the engine is gone).
The page's test of that route starts a real ``engine serve``, which finds the endpoint
through an installed ``.dist-info`` on its ``PYTHONPATH``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from engine.core.client.async_llm import AsyncLLM, in_process_client
from engine.core.config import EngineConfig
from engine.core.plugins import PluginEntry, _catalog
from engine.sdk.groups import ENDPOINTS
from engine.server.app import build_app
from engine.testing.docs import PLUGIN_DOCS, code_block, page_package, run_page_tests

PAGE = "endpoints.md"
MODULE, TEST = "# src/acme_plugins/readiness.py", "# tests/test_readiness.py"
COMPLETE, COMPLETE_TEST = "# src/acme_plugins/complete.py", "# tests/test_complete.py"
VALUE = "acme_plugins.readiness:ReadinessEndpoint"
ENTRIES = {"acme_ready": VALUE, "acme_complete": "acme_plugins.complete:CompleteEndpoint"}


@pytest.fixture(scope="module")
def acme(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    modules = {"readiness": code_block(PAGE, MODULE), "complete": code_block(PAGE, COMPLETE)}
    with page_package(tmp_path_factory.mktemp("docs"), "acme_plugins", modules) as root:
        yield root


@pytest.fixture
def installed(acme: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The page's entry points, as ``pip install`` of the page's distribution would add them."""
    assert f'[project.entry-points."{ENDPOINTS}"]\n' + "".join(
        f'{name} = "{value}"\n' for name, value in ENTRIES.items()) in (
        PLUGIN_DOCS / PAGE).read_text()
    monkeypatch.delenv("ENGINE_PLUGINS", raising=False)
    entries = [PluginEntry(ENDPOINTS, name, value, "acme-engine-plugins", "0.3.0")
               for name, value in ENTRIES.items()]
    discover = _catalog.discover_entries
    monkeypatch.setattr(_catalog, "discover_entries", lambda: [*discover(), *entries])


def test_the_pages_test_passes(acme: Path) -> None:
    assert run_page_tests(code_block(PAGE, TEST), "test_readiness.py") == [
        "test_ready_only_after_init_state"]


@pytest.mark.parametrize("allowlist", ["endpoints:acme_ready", "acme-engine-plugins"])
def test_the_allowlisted_endpoint_is_served(installed: None, tiny_llama_checkpoint: Path,
                                            allowlist: str) -> None:
    config = EngineConfig(model=str(tiny_llama_checkpoint), dtype="float32", num_kv_blocks=32,
                          plugins=allowlist)
    app = build_app(AsyncLLM(config, client=in_process_client, log_stats=False))
    assert TestClient(app).get("/acme/ready").status_code == 503  # no lifespan: not started
    with TestClient(app) as client:  # the lifespan starts the engine, then init_state
        response = client.get("/acme/ready")
        assert response.status_code == 200
        assert response.json()["ready"] is True and response.json()["since"] > 0


def test_an_endpoint_not_named_is_not_served(installed: None,
                                             tiny_llama_checkpoint: Path) -> None:
    config = EngineConfig(model=str(tiny_llama_checkpoint), dtype="float32", num_kv_blocks=32)
    app = build_app(AsyncLLM(config, client=in_process_client, log_stats=False))
    assert TestClient(app).get("/acme/ready").status_code == 404  # opt-in, even when unset


def test_the_route_that_generates_uses_the_engine_client(installed: None,
                                                        tiny_llama_checkpoint: Path) -> None:
    config = EngineConfig(model=str(tiny_llama_checkpoint), dtype="float32", num_kv_blocks=32,
                          plugins="endpoints:acme_complete")
    app = build_app(AsyncLLM(config, client=in_process_client, log_stats=False))
    with TestClient(app) as client:
        reply = client.post("/acme/complete", json={"prompt": "Hello", "max_tokens": 5})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        # The engine's own route, same prompt and sampling: the same completion.
        model = client.get("/v1/models").json()["data"][0]["id"]
        [choice] = client.post("/v1/completions", json={
            "model": model, "prompt": "Hello", "max_tokens": 5, "temperature": 0}).json()[
            "choices"]
        assert (body["text"], body["finish_reason"]) == (choice["text"],
                                                          choice["finish_reason"])
        assert 1 <= body["num_tokens"] <= 5
        # The page's "Errors need no code of yours": OpenAI-shaped 400s.
        refused = client.post("/acme/complete", json={"prompt": "Hello", "max_tokens": 0})
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "max_tokens"
        assert "max_tokens must be an integer >= 1" in refused.json()["error"]["message"]
        too_long = client.post("/acme/complete", json={"prompt": "x" * 5000})
        assert too_long.status_code == 400, too_long.text
        assert "context" in too_long.json()["error"]["message"]
        shapeless = client.post("/acme/complete", json={"max_tokens": 2})
        assert shapeless.status_code == 400
        assert "prompt" in shapeless.json()["error"]["message"]
    # The lifespan shut the engine down: generate raises EngineDeadError, answered 503.
    dead = TestClient(app).post("/acme/complete", json={"prompt": "Hi"})
    assert dead.status_code == 503 and dead.json()["error"]["type"] == "server_error"


@pytest.fixture
def site(acme: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``pip install`` of the page's distribution, seen by processes this test starts."""
    info = tmp_path / "acme_engine_plugins-0.3.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-engine-plugins\n"
                                   "Version: 0.3.0\n")
    (info / "entry_points.txt").write_text(f"[{ENDPOINTS}]\n" + "".join(
        f"{name} = {value}\n" for name, value in ENTRIES.items()))
    path = os.pathsep.join(p for p in (str(tmp_path), str(acme), os.environ.get("PYTHONPATH"))
                           if p)
    monkeypatch.setenv("PYTHONPATH", path)
    return tmp_path


def test_the_pages_test_of_the_route_that_generates_passes(
        site: Path, tiny_llama_checkpoint: Path) -> None:
    assert run_page_tests(code_block(PAGE, COMPLETE_TEST), "test_complete.py",
                          tiny_llama_checkpoint=tiny_llama_checkpoint) == [
        "test_complete_answers_and_refuses"]
