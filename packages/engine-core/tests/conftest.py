"""Shared fixtures of engine-core's tests: tiny checkpoints and their transformers twins."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session", autouse=True)
def _no_hub(hub_offline: None) -> None:
    """Every test runs without Hugging Face Hub access (engine.testing's ``hub_offline``)."""


@pytest.fixture
def choice_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache directory of its own for measured kernel choices, which keeps every record.

    A record measured on a busy machine is measured again at the next start
    (test_kernel_choice tests that); the tests using this one read their record back.
    """
    from engine.core.kernel_choice import selection

    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(selection, "STEADY_SPREAD", float("inf"))
    return tmp_path


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_checkpoint: Path) -> Path:
    """engine.testing's tiny random Llama checkpoint (built once per run, deterministic)."""
    return tiny_llama_checkpoint


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.testing.models import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "qwen2", "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Per-head q/k norms of random weights, ``head_dim`` 32 (not hidden / heads), untied."""
    from engine.testing.models import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "qwen3", "qwen3")


@pytest.fixture(scope="session")
def tiny_mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 layers of 4 experts (intermediate 96, top 2), a decisive router, untied head."""
    from engine.testing.models import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "mixtral", "mixtral")


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 layers: 6 experts (intermediate 48, top 2) in 0 and 2, 1 dense; norm_topk_prob."""
    from engine.testing.models import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "qwen3_moe", "qwen3_moe",
                                 norm_topk_prob=True)


@pytest.fixture(scope="session")
def tiny_gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 layers alternating window 8 and full; sinks; 4 biased experts (top 2); YaRN."""
    from engine.testing.models import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "gpt_oss", "gpt_oss")


class TinyLLMFactory:
    """Stands in for ``engine.core.LLM`` in a docs page's blocks: the tiny checkpoint, fast.

    Whatever model a block names, the engine is the tiny Llama in process (float32, 32 KV
    blocks); its keyword arguments win. ``made`` lists the engines built, in order.
    """

    def __init__(self, model: Path) -> None:
        self.model = model
        self.made: list[Any] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from engine.core.llm import LLM  # the class itself: engine.core.LLM is this factory

        options = {"dtype": "float32", "in_process": True, "num_kv_blocks": 32, **kwargs}
        self.made.append(LLM(str(self.model), **options))
        return self.made[-1]


@pytest.fixture
def tiny_llm(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[TinyLLMFactory]:
    """``from engine.core import LLM`` in a page block builds the tiny test checkpoint.

    Every installed plugin is allowed (``ENGINE_PLUGINS`` unset) while the test runs; the
    engines built are shut down after it.
    """
    import engine.core

    factory = TinyLLMFactory(tiny_llama)
    monkeypatch.setattr(engine.core, "LLM", factory, raising=False)
    monkeypatch.delenv("ENGINE_PLUGINS", raising=False)
    yield factory
    for llm in factory.made:
        llm.shutdown()
