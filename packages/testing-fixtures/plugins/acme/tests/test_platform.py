"""acme_cpu: claims the host only when ACME_ENGINE_PLATFORM=1, and then shapes the engine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from acme_engine_plugins.attention import SDPAImpl
from acme_engine_plugins.platform import ENV_VAR, AcmeCPUPlatform, detect

from engine.sdk import PlatformConfig


def test_no_claim_unless_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert detect() is None
    assert ENV_VAR in AcmeCPUPlatform.is_available().reason
    monkeypatch.setenv(ENV_VAR, "1")
    assert detect() is AcmeCPUPlatform
    info = AcmeCPUPlatform.info(0)
    assert (info.name, info.device_type) == ("acme_cpu", "cpu")
    assert info.total_memory_bytes > 0


@pytest.mark.parametrize(("given", "block_size"), [(16, 32), (32, 32), (48, 64), (None, 32)])
def test_config_changes(given: int | None, block_size: int) -> None:
    config = PlatformConfig(dtype="auto", block_size=given)
    AcmeCPUPlatform.check_and_update_config(config)
    assert (config.dtype, config.block_size) == ("float32", block_size)
    config = PlatformConfig(dtype="bfloat16", block_size=16)
    AcmeCPUPlatform.check_and_update_config(config)
    assert config.dtype == "bfloat16"  # the operator's choice stands


def test_enabled_it_runs_the_engine(
    tiny_qwen3: Path, make_llm: Callable[..., Any], spy: Callable[..., Any],
    greedy: Callable[..., Any], prompts: list[list[int]], qwen3_tokens: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = spy(SDPAImpl, "forward")
    monkeypatch.delenv(ENV_VAR, raising=False)
    with make_llm(tiny_qwen3) as llm:
        greedy(llm, prompts[:1], max_tokens=2)
    assert calls["forward"] == 0  # the engine's own cpu platform, its own attention
    monkeypatch.setenv(ENV_VAR, "1")
    with make_llm(tiny_qwen3, dtype="auto") as llm:
        assert greedy(llm, prompts) == qwen3_tokens  # float32 on the CPU, as before
        assert llm.llm_engine.setup.block_size == 32
    assert calls["forward"] > 0  # the platform's default attention backend: acme_sdpa
