"""The frozen SDK 1.0 plugins that run in the workers beside the model.

The logits processor (its ``validate_params`` in the front end, ``apply`` in the worker,
only for the requests that ask for it) and the worker extension (reached through
``collective_rpc``, with one and two ranks). See ``test_sdk1_distribution.py`` for what
these tests prove and why the plugin is never edited.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.core.messages import CollectiveRpcError
from engine.sdk import (
    SamplingParams,
    ValidationError,
)
from engine.sdk import groups as sdk_groups
from engine.testing.contracts import (
    check_logits_processor,
)
from engine.testing.engine import assert_kv_pool_full
from engine.testing.sdk1 import (
    GREEDY,
    PROMPTS,
    counting,
    greedy,
    sdk1_catalog,
    sdk1_llm,
)

pytestmark = pytest.mark.filterwarnings("default::engine.sdk.deprecation.SDKDeprecationWarning")


def test_logits_processor_applies_only_to_requests_that_ask(
        tiny_llama: Path, sdk1: Path, reference: list[list[int]]) -> None:
    window = GREEDY.max_tokens
    assert len(set(reference[2])) < len(reference[2]), "pick a prompt whose greedy repeats"
    asking = GREEDY.replace(extra_args={"sdk1_no_repeat": window})
    with counting() as calls, sdk1_llm(tiny_llama) as llm:
        mixed = greedy(llm, [PROMPTS[2], PROMPTS[2], PROMPTS[0]], [asking, GREEDY, GREEDY])
        assert len(set(mixed[0])) == len(mixed[0])  # no token repeated in the window
        assert mixed[1:] == [reference[2], reference[0]]  # the others are untouched
        for bad in ("x", 0, 5000):
            with pytest.raises(ValidationError) as info:  # validate_params, front end
                greedy(llm, [PROMPTS[0]], GREEDY.replace(extra_args={"sdk1_no_repeat": bad}))
            assert info.value.param == "extra_args.sdk1_no_repeat"
        assert_kv_pool_full(llm)
    assert calls["sdk1_no_repeat.apply"] > 0 and calls["sdk1_no_repeat.rows_changed"] > 0
    cls = sdk1_catalog().load(sdk_groups.LOGITS_PROCESSORS, "sdk1_no_repeat")

    def make_params(rng: Any) -> SamplingParams:
        if rng.random() < 0.4:
            return SamplingParams()
        return SamplingParams(extra_args={"sdk1_no_repeat": rng.randint(1, 6)})

    def slot_free(params: SamplingParams, prompt_ids: Any, output_ids: Sequence[int],
                  row: torch.Tensor) -> torch.Tensor:
        size = (params.extra_args or {}).get("sdk1_no_repeat")
        for token in output_ids[-size:] if size else ():
            row[token] = float("-inf")
        return row

    report = check_logits_processor(cls, make_params, reference=slot_free, steps=600)
    assert report.num_rows_changed > 0


def test_worker_extension_through_collective_rpc(tiny_llama: Path, sdk1: Path) -> None:
    with counting() as calls, sdk1_llm(tiny_llama, worker_extensions=["sdk1_inspect"]) as llm:
        worker = llm.llm_engine.core.worker  # uni: the worker runs in this process
        [memory] = llm.collective_rpc("sdk1_memory")
        assert memory == {
            "rank": 0, "world_size": 1, "device": "cpu",
            "parameter_bytes": sum(p.numel() * 4 for p in worker.model.parameters()),
            "kv_cache_bytes": sum(t.numel() * 4 for t in worker.kv_caches.values()),
            "kv_cache_layers": sorted(worker.kv_caches)}
        assert llm.collective_rpc("sdk1_weights_changed") == [False]
        with torch.no_grad():
            worker.model.norm.weight.add_(1.0)
        assert llm.collective_rpc("sdk1_weights_changed") == [True]
    assert calls["sdk1_inspect.init"] == 1 and calls["sdk1_inspect.destroy"] == 1
    assert calls["sdk1_inspect.memory"] == 1
    with sdk1_llm(tiny_llama, worker_extensions=["sdk1_inspect"], tensor_parallel_size=2) as llm:
        memories = llm.collective_rpc("sdk1_memory")  # two worker processes
        assert [(m["rank"], m["world_size"]) for m in memories] == [(0, 2), (1, 2)]
        fingerprints = llm.collective_rpc("sdk1_fingerprint", timeout=30)
        assert fingerprints[0]["sha256"] != fingerprints[1]["sha256"]  # each rank's shard
        assert llm.collective_rpc("sdk1_weights_changed") == [False, False]
    with sdk1_llm(tiny_llama) as llm:  # allowed, not selected: not reachable
        with pytest.raises(CollectiveRpcError, match="no worker extension defines"):
            llm.collective_rpc("sdk1_memory")
