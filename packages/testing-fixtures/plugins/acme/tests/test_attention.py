"""acme_sdpa: the conformance suite, and the engine's tokens through it equal the default's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from acme_engine_plugins.attention import AcmeSDPABackend, SDPAImpl

from engine.testing.contracts import DEFAULT_ATTENTION_CASES, check_attention_backend
from engine.testing.engine import assert_kv_pool_full


def test_conforms_on_every_default_case() -> None:
    report = check_attention_backend(AcmeSDPABackend)
    assert report.skipped == ()  # sliding windows included
    assert len(report.cases) == len(DEFAULT_ATTENTION_CASES)


def test_bfloat16_conforms() -> None:
    report = check_attention_backend(AcmeSDPABackend, dtype="bfloat16",
                                     cases=DEFAULT_ATTENTION_CASES[:3])
    assert report.skipped == ()


def test_selected_it_serves_the_engine_with_the_same_tokens(
    tiny_qwen3: Path, make_llm: Callable[..., Any], spy: Callable[..., Any],
    greedy: Callable[..., Any], prompts: list[list[int]], qwen3_tokens: list[list[int]],
) -> None:
    calls = spy(SDPAImpl, "forward")
    with make_llm(tiny_qwen3) as llm:
        assert greedy(llm, prompts) == qwen3_tokens
    assert calls["forward"] == 0  # not selected: the platform's default served
    with make_llm(tiny_qwen3, attention_backend="acme_sdpa") as llm:
        assert greedy(llm, prompts) == qwen3_tokens
        assert_kv_pool_full(llm)
    assert calls["forward"] > 0
