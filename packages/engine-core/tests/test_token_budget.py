"""The token budget of a step: ``--max-num-batched-tokens``, else the platform's, else 2048."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.core import LLM
from engine.core.config import EngineConfig
from engine.core.platforms import _builtin
from engine.core.platforms._builtin import CPU_TOKEN_BUDGET, CpuPlatform
from engine.core.startup import DEFAULT_MAX_NUM_BATCHED_TOKENS, prepare
from engine.sdk import PlatformConfig, SamplingParams
from engine.sdk.errors import ValidationError


def _budget(checkpoint: Path, **kwargs: Any) -> int:
    setup = prepare(EngineConfig(model=str(checkpoint), plugins="none", **kwargs))
    return setup.max_num_batched_tokens


def test_the_cpu_platform_chooses_512_and_the_operator_wins(tiny_llama: Path) -> None:
    config = PlatformConfig()
    CpuPlatform.check_and_update_config(config)
    assert config.max_num_batched_tokens == CPU_TOKEN_BUDGET == 512
    config = PlatformConfig(max_num_batched_tokens=3000)
    CpuPlatform.check_and_update_config(config)  # the operator's value is kept
    assert config.max_num_batched_tokens == 3000
    assert _budget(tiny_llama) == 512
    assert _budget(tiny_llama, max_num_batched_tokens=100) == 100
    assert _budget(tiny_llama, enable_chunked_prefill=False) == 512  # above the 256 context


def test_without_chunked_prefill_a_chosen_budget_rises_to_the_context(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_builtin, "CPU_TOKEN_BUDGET", 100)
    assert _budget(tiny_llama) == 100
    # A prompt must fit one step: the platform's 100 rises to max_model_len.
    assert _budget(tiny_llama, enable_chunked_prefill=False) == 256
    assert _budget(tiny_llama, enable_chunked_prefill=False, max_model_len=64) == 100
    # The operator's own budget is kept (the scheduler refuses it, with the reason).
    assert _budget(tiny_llama, enable_chunked_prefill=False, max_num_batched_tokens=50) == 50


@pytest.mark.parametrize(("choice", "expected"), [(None, DEFAULT_MAX_NUM_BATCHED_TOKENS),
                                                  (4096, 4096)])
def test_a_platform_choice_applies_where_the_operator_gave_none(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, choice: int | None,
        expected: int) -> None:
    def check_and_update_config(cls: type, config: PlatformConfig) -> None:
        if config.max_num_batched_tokens is None:
            config.max_num_batched_tokens = choice

    monkeypatch.setattr(CpuPlatform, "check_and_update_config",
                        classmethod(check_and_update_config))
    assert _budget(tiny_llama) == expected
    assert _budget(tiny_llama, max_num_batched_tokens=7) == 7


@pytest.mark.parametrize("bad", [0, -5, 2.5, True])
def test_a_bad_platform_choice_names_the_platform(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, bad: Any) -> None:
    def check_and_update_config(cls: type, config: PlatformConfig) -> None:
        config.max_num_batched_tokens = bad

    monkeypatch.setattr(CpuPlatform, "check_and_update_config",
                        classmethod(check_and_update_config))
    with pytest.raises(ValidationError, match=f"^platform cpu set max_num_batched_tokens to "
                       f"{bad!r}; it must be an int >= 1"):
        _budget(tiny_llama)


def test_the_scheduler_and_workers_run_on_the_resolved_budget(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_builtin, "CPU_TOKEN_BUDGET", 64)
    prompt = {"prompt_token_ids": list(range(5, 5 + 100))}  # > 64: two prefill steps
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with LLM(str(tiny_llama), dtype="float32", in_process=True, num_kv_blocks=64,
             plugins="none") as llm:
        core = llm.llm_engine.core
        assert core.scheduler.ctx.max_num_batched_tokens == 64
        assert core.worker.model_runner.builder.ctx.max_num_batched_tokens == 64
        steps = []
        step = core.scheduler.schedule

        def schedule() -> Any:
            out = step()
            steps.append(out.total_num_scheduled_tokens)
            return out

        core.scheduler.schedule = schedule  # type: ignore[method-assign]
        [out] = llm.generate(prompt, greedy, use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 3
        assert [n for n in steps if n][:2] == [64, 36]  # the prompt in two chunks
