"""Integration-test fixtures: no Hub access, a tiny checkpoint, the frozen sdk1 plugins.

The sdk1 tests' helpers (``sdk1_llm``, ``greedy``, ``counting``, ``sdk1_catalog``, the
prompts) live in ``engine.testing.sdk1``: with ``--import-mode=importlib`` a test module
cannot import a sibling.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.testing.sdk1 import greedy, sdk1_llm
from engine.testing.test_plugins import install_test_plugins, put_on_path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session", autouse=True)
def _no_hub(hub_offline: None) -> None:
    """Every test runs without Hugging Face Hub access (engine.testing's ``hub_offline``)."""


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_checkpoint: Path) -> Path:
    """engine.testing's tiny random Llama checkpoint (built once per run, deterministic)."""
    return tiny_llama_checkpoint


@pytest.fixture(scope="session")
def sdk1_plugin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The frozen ``engine-test-plugin-sdk1`` distribution, pip-installed into a directory."""
    return install_test_plugins(tmp_path_factory.mktemp("sdk1-plugin"), ("sdk1",))


@pytest.fixture
def sdk1(sdk1_plugin_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Put the installed sdk1 plugins on ``sys.path`` for this test (discoverable, importable)."""
    monkeypatch.delenv("ENGINE_TEST_SDK1_PLATFORM", raising=False)
    yield put_on_path(sdk1_plugin_dir, monkeypatch)


@pytest.fixture(scope="session")
def reference(tiny_llama: Path) -> list[list[int]]:
    """Greedy tokens of the sdk1 ``PROMPTS`` with built-ins only (no plugin allowed)."""
    with sdk1_llm(tiny_llama, plugins="none") as llm:
        return greedy(llm)
