"""Shared fixtures of engine-core's tests: tiny checkpoints and their transformers twins."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session", autouse=True)
def _no_hub(hub_offline: None) -> None:
    """Every test runs without Hugging Face Hub access (engine.testing's ``hub_offline``)."""


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_checkpoint: Path) -> Path:
    """engine.testing's tiny random Llama checkpoint (built once per run, deterministic)."""
    return tiny_llama_checkpoint


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.testing.models import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "qwen2", "qwen2")
