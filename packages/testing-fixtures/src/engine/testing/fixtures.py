"""pytest fixtures shared by the engine's test suites and by plugin authors."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.testing.test_plugins import install_test_plugins, put_on_path


@pytest.fixture(scope="session")
def hub_offline() -> Iterator[None]:
    """No Hugging Face Hub access for the session, even if transformers is already imported.

    Request it from an autouse fixture in a ``conftest.py`` to cover a whole suite.
    """
    import huggingface_hub.constants

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield


@pytest.fixture(scope="session")
def test_plugins_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with every test plugin distribution pip-installed into it (once per run)."""
    return install_test_plugins(tmp_path_factory.mktemp("test-plugins"))


@pytest.fixture
def plugins_on_path(test_plugins_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Put the installed test plugins on ``sys.path`` for this test (discoverable, importable)."""
    yield put_on_path(test_plugins_dir, monkeypatch)


@pytest.fixture(scope="session")
def fault_plugins_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``engine-test-plugin-faults`` (plugins that raise on demand), installed on its own."""
    return install_test_plugins(tmp_path_factory.mktemp("fault-plugins"), ("faults",))


@pytest.fixture(scope="session")
def tiny_llama_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama checkpoint with a byte-level tokenizer and a chat template."""
    from engine.testing.models import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")


@pytest.fixture
def deprecate_hook(monkeypatch: pytest.MonkeyPatch) -> Callable[[type, str, str], None]:
    """``deprecate_hook(SDKClass, "method", "replacement")``: deprecate an SDK hook for one test.

    What a later 1.x release would do (``@deprecated_hook(since=<running minor>)``), undone
    after the test; the SDK's deprecation registry and once-per-plugin memory are restored
    too. Use it to see how a plugin is warned about, and that it keeps working.
    """
    from engine.sdk import __version__, deprecation

    monkeypatch.setattr(deprecation, "_registry", dict(deprecation._registry))
    monkeypatch.setattr(deprecation, "_warned", set())
    since = ".".join(__version__.split(".")[:2])

    def mark(cls: type, name: str, replacement: str) -> None:
        original = cls.__dict__[name]

        @functools.wraps(original)
        def hook(*args: Any, **kwargs: Any) -> Any:
            return original(*args, **kwargs)

        marker = deprecation.deprecated_hook(since=since, replacement=replacement)
        monkeypatch.setattr(cls, name, marker(hook))

    return mark
