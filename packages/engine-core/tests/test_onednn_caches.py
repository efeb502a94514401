"""oneDNN's per-shape caches are bounded in every process that runs the model on the CPU.

Unbounded (1,024 entries each), they grew EngineCore by ~0.6 MiB per new step size under a
soak (``benchmarks/soak.py``, benchmarks/README.md "Memory under a soak").
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.core import LLM, SamplingParams
from engine.core.worker.onednn_caches import (
    CAPACITY_VARIABLES,
    DEFAULT_CAPACITY,
    bound_onednn_caches,
)


def unset_capacities(monkeypatch: pytest.MonkeyPatch) -> None:
    """Remove both variables for this test (and restore whatever was there after it)."""
    for name in CAPACITY_VARIABLES:
        monkeypatch.setenv(name, "0")  # records the original value for the undo
        monkeypatch.delenv(name)


def test_worker_bounds_both_caches_before_it_loads(tiny_llama: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    unset_capacities(monkeypatch)
    with LLM(str(tiny_llama), dtype="float32", num_kv_blocks=32, in_process=True) as llm:
        out = llm.generate({"prompt_token_ids": [5, 6, 7]},
                           SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                           use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    assert {name: os.environ.get(name) for name in CAPACITY_VARIABLES} == {
        name: str(DEFAULT_CAPACITY) for name in CAPACITY_VARIABLES}


def test_an_operator_capacity_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    unset_capacities(monkeypatch)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "32")
    assert bound_onednn_caches() == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "32",
                                     "LRU_CACHE_CAPACITY": str(DEFAULT_CAPACITY)}


def test_a_negative_capacity_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    unset_capacities(monkeypatch)
    with pytest.raises(ValueError, match="must be 0 or more, not -1"):
        bound_onednn_caches(-1)
    assert not any(name in os.environ for name in CAPACITY_VARIABLES)
