"""acme_lazy: the conformance suite (alone and with a policy), then whole engines."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from acme_engine_plugins.policy import ShortestJobFirst
from acme_engine_plugins.scheduler import LazyScheduler

from engine.sdk import PluginError, SchedulerContext, SchedulingPolicyContext
from engine.testing.contracts import check_scheduler
from engine.testing.engine import assert_kv_pool_full


def test_conforms() -> None:
    report = check_scheduler(LazyScheduler)
    assert report.num_preempted > 0 and report.num_partial_chunks > 0


def test_conforms_with_a_policy() -> None:
    sjf = ShortestJobFirst(SchedulingPolicyContext(options=ShortestJobFirst.Options()))
    calls: list[int] = []
    original = sjf.select_preemption_victim

    def counting(running: Any) -> Any:
        calls.append(1)
        return original(running)

    sjf.select_preemption_victim = counting
    context = SchedulerContext(plugin_name="acme_lazy", block_size=4, num_kv_blocks=64,
                               max_num_seqs=16, max_num_batched_tokens=64, max_model_len=64,
                               policy=sjf)
    check_scheduler(LazyScheduler, context=context)
    assert calls  # the policy chose the victims


def test_the_engine_runs_on_it(
    tiny_qwen3: Path, make_llm: Callable[..., Any], spy: Callable[..., Any],
    greedy: Callable[..., Any], prompts: list[list[int]], qwen3_tokens: list[list[int]],
) -> None:
    calls = spy(LazyScheduler, "schedule")
    preemptions = spy(LazyScheduler, "_preempt")
    with make_llm(tiny_qwen3) as llm:
        greedy(llm, prompts[:1], max_tokens=2)
    assert calls["schedule"] == 0  # not selected: the default scheduler
    # 16 blocks of 4 tokens for three requests that need 26: some are preempted, recomputed
    with make_llm(tiny_qwen3, scheduler="acme_lazy", num_kv_blocks=16, block_size=4,
                  max_model_len=64, max_num_batched_tokens=32) as llm:
        assert greedy(llm, prompts) == qwen3_tokens
        assert_kv_pool_full(llm)
    assert calls["schedule"] > 0 and preemptions["_preempt"] > 0


def test_it_refuses_a_kv_connector_at_start_up(
    tiny_qwen3: Path, make_llm: Callable[..., Any],
) -> None:
    with pytest.raises(PluginError, match="cannot drive a KV connector"):
        make_llm(tiny_qwen3, scheduler="acme_lazy", kv_connector="acme_lru")
