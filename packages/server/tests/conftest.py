"""Shared fixtures of the server tests: one real ``engine serve`` per test module."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.testing.server import RemoteServer, running_server

os.environ.setdefault("HF_HUB_OFFLINE", "1")

API_KEY = "test-key"


@pytest.fixture(scope="module")
def server(tiny_llama_checkpoint: Path) -> Iterator[RemoteServer]:
    """``engine serve`` on the tiny checkpoint, with an API key, no plugins."""
    env = dict(os.environ, ENGINE_PLUGINS="none")
    with running_server(tiny_llama_checkpoint, served_model_name="tiny", api_key=API_KEY,
                        env=env) as remote:
        yield remote
