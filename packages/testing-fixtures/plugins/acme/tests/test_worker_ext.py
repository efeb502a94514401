"""acme_inspect: reachable through collective_rpc when selected, and only then."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from acme_engine_plugins.worker_ext import AcmeInspect


class FakeWorker:
    def __init__(self) -> None:
        from engine.sdk.ops import RMSNormOp

        self.rank, self.world_size, self.device = 0, 1, torch.device("cpu")
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 4), RMSNormOp(4))
        self.kv_caches = {"layers.0": torch.zeros(2, 8, 16, 2, 4)}


class Worker(FakeWorker, AcmeInspect):
    pass


def test_answers_on_a_stand_in_worker() -> None:
    worker = Worker()
    assert worker.acme_ops() == {"rank": 0,
                                 "ops": {"rms_norm": ["engine.sdk.ops:RMSNormOp"]}}
    assert worker.acme_memory() == {"rank": 0, "parameter_bytes": (20 + 4) * 4,
                                    "kv_cache_bytes": 2 * 8 * 16 * 2 * 4 * 4}


def test_selected_it_answers_from_the_worker(
    tiny_qwen3: Path, make_llm: Callable[..., Any],
) -> None:
    with make_llm(tiny_qwen3, worker_extensions=["acme_inspect"]) as llm:
        [memory] = llm.collective_rpc("acme_memory")
        [ops] = llm.collective_rpc("acme_ops")
    assert memory["rank"] == 0 and memory["parameter_bytes"] > 0
    assert memory["kv_cache_bytes"] > 0
    assert set(ops["ops"]) == {"rms_norm", "rotary_embedding", "silu_and_mul"}


def test_not_selected_its_methods_are_not_reachable(
    tiny_qwen3: Path, make_llm: Callable[..., Any],
) -> None:
    with make_llm(tiny_qwen3) as llm, pytest.raises(Exception, match="acme_memory"):
        llm.collective_rpc("acme_memory")
