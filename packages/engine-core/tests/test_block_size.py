"""Tokens per KV-cache block: the platform's choice, which starts from ``--block-size``.

``PlatformConfig.block_size`` is ``None`` when the operator gave no ``--block-size``, so a
platform can tell "not chosen" from a chosen 16; the engine's default (16) applies after
the platform, where neither chose.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.core import LLM
from engine.core.config import EngineConfig
from engine.core.platforms._builtin import CpuPlatform
from engine.core.startup import DEFAULT_BLOCK_SIZE, prepare
from engine.sdk import PlatformConfig, SamplingParams


def _block_size(checkpoint: Path, **kwargs: Any) -> int:
    return prepare(EngineConfig(model=str(checkpoint), plugins="none", **kwargs)).block_size


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> list[int | None]:
    """The CPU platform sets 32 only where the operator chose no block size; what it saw."""
    seen: list[int | None] = []

    def check_and_update_config(cls: type, config: PlatformConfig) -> None:
        seen.append(config.block_size)
        if config.block_size is None:
            config.block_size = 32

    monkeypatch.setattr(CpuPlatform, "check_and_update_config",
                        classmethod(check_and_update_config))
    return seen


def test_the_platform_sees_none_without_the_flag_and_the_operators_value_with_it(
        tiny_llama: Path, seen: list[int | None]) -> None:
    assert _block_size(tiny_llama) == 32
    assert _block_size(tiny_llama, block_size=16) == 16  # the operator chose the default
    assert _block_size(tiny_llama, block_size=8) == 8
    assert seen == [None, 16, 8]


def test_the_default_applies_where_neither_chose(tiny_llama: Path) -> None:
    assert EngineConfig(model=str(tiny_llama)).block_size is None
    assert _block_size(tiny_llama) == DEFAULT_BLOCK_SIZE == 16
    assert _block_size(tiny_llama, block_size=8) == 8


def test_a_platform_leaving_none_falls_back_to_the_operators_value(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def check_and_update_config(cls: type, config: PlatformConfig) -> None:
        config.block_size = None

    monkeypatch.setattr(CpuPlatform, "check_and_update_config",
                        classmethod(check_and_update_config))
    assert _block_size(tiny_llama, block_size=8) == 8
    assert _block_size(tiny_llama) == DEFAULT_BLOCK_SIZE


def test_the_engine_runs_on_the_platforms_choice(tiny_llama: Path,
                                                 seen: list[int | None]) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with LLM(str(tiny_llama), dtype="float32", in_process=True, num_kv_blocks=16,
             plugins="none") as llm:
        assert llm.llm_engine.setup.block_size == 32
        assert llm.llm_engine.core.scheduler.ctx.block_size == 32
        [output] = llm.generate({"prompt_token_ids": list(range(5, 45))}, greedy,
                                use_tqdm=False)
        assert len(output.outputs[0].token_ids) == 3
    assert None in seen
