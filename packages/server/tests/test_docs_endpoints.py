"""docs/plugins/endpoints.md: the readiness endpoint passes its test and is served.

The page's module is written to a temporary ``acme_plugins/readiness.py`` and installed
as the ``engine.endpoints`` entry its "Registering" section shows; its test runs as
written; then a server app, with the endpoint named in the allowlist as "Selecting and
configuring" says, answers 503 before its lifespan started the engine and 200 after.
"""

from __future__ import annotations

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
VALUE = "acme_plugins.readiness:ReadinessEndpoint"


@pytest.fixture(scope="module")
def acme(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    modules = {"readiness": code_block(PAGE, MODULE)}
    with page_package(tmp_path_factory.mktemp("docs"), "acme_plugins", modules) as root:
        yield root


@pytest.fixture
def installed(acme: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The page's entry point, as ``pip install`` of the page's distribution would add it."""
    assert f'[project.entry-points."{ENDPOINTS}"]\nacme_ready = "{VALUE}"' in (
        PLUGIN_DOCS / PAGE).read_text()
    monkeypatch.delenv("ENGINE_PLUGINS", raising=False)
    entry = PluginEntry(ENDPOINTS, "acme_ready", VALUE, "acme-engine-plugins", "0.3.0")
    discover = _catalog.discover_entries
    monkeypatch.setattr(_catalog, "discover_entries", lambda: [*discover(), entry])


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
