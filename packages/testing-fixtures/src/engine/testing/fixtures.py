"""pytest fixtures shared by the engine's test suites and by plugin authors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.testing.test_plugins import install_test_plugins


@pytest.fixture(scope="session")
def test_plugins_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with every test plugin distribution pip-installed into it (once per run)."""
    return install_test_plugins(tmp_path_factory.mktemp("test-plugins"))


@pytest.fixture
def plugins_on_path(test_plugins_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Put the installed test plugins on ``sys.path`` for this test (discoverable, importable)."""
    monkeypatch.syspath_prepend(str(test_plugins_dir))
    monkeypatch.delenv("ENGINE_PLUGINS", raising=False)
    yield test_plugins_dir


@pytest.fixture(scope="session")
def tiny_llama_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama checkpoint with a byte-level tokenizer and a chat template."""
    from engine.testing.models import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")
