"""The worker's warm-up forward pass: once, on the null block only; it never stops a start."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.core import LLM, SamplingParams
from engine.core.worker.model_runner import ModelRunner

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = {"prompt_token_ids": [4, 8, 15, 16, 23, 42]}


def caches_of(llm: LLM) -> list[torch.Tensor]:
    return list(llm.llm_engine.core.worker.kv_caches.values())


def test_warm_up_writes_the_null_block_only(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, in_process=True)
    caches = caches_of(llm)
    # [2 (keys, values), blocks, ...]: the warm-up's keys and values went to block 0, which
    # no request is given; every other block is still the zeros it was allocated as.
    assert all(cache[:, 0].abs().sum() > 0 for cache in caches)
    assert all(not cache[:, 1:].any() for cache in caches)
    assert llm.generate(PROMPT, PARAMS, use_tqdm=False)[0].outputs[0].token_ids


def test_a_failing_warm_up_is_a_warning_and_the_engine_serves(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    want = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, in_process=True).generate(
        PROMPT, PARAMS, use_tqdm=False)[0].outputs[0].token_ids

    def broken(self: ModelRunner) -> None:
        raise RuntimeError("kernel set-up failed")

    monkeypatch.setattr(ModelRunner, "warm_up", broken)
    with caplog.at_level(logging.WARNING, logger="engine.worker"):
        llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, in_process=True)
    assert "warm-up forward pass failed (RuntimeError: kernel set-up failed)" in caplog.text
    assert all(not cache.any() for cache in caches_of(llm))
    assert llm.generate(PROMPT, PARAMS, use_tqdm=False)[0].outputs[0].token_ids == want


def test_the_kv_prefault_starts_after_the_warm_up_and_the_capture(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.core.worker import worker as worker_module

    order: list[str] = []

    def noted(name: str, call: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            order.append(name)
            return call(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(ModelRunner, "warm_up", noted("warm_up", ModelRunner.warm_up))
    monkeypatch.setattr(worker_module.Worker, "capture_step_graph",
                        noted("capture", worker_module.Worker.capture_step_graph))
    monkeypatch.setattr(worker_module, "KVPrefault", noted("prefault", worker_module.KVPrefault))
    with LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, in_process=True) as llm:
        assert order == ["warm_up", "capture", "prefault"]
        assert llm.llm_engine.core.worker.kv_prefault is not None
        assert llm.generate(PROMPT, PARAMS, use_tqdm=False)[0].outputs[0].token_ids
