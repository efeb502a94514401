"""``--gpu-memory-utilization``: the KV cache's share of the GPU (the arithmetic, no GPU).

On a GPU, ``packages/engine-kernels/tests/test_gpu.py`` checks the whole path (the step
measured, the cache allocated, requests served).
"""

from __future__ import annotations

import pytest

from engine.core.worker.gpu_memory import OVERHEAD_BYTES, kv_cache_budget
from engine.sdk.errors import ValidationError

GIB = 1 << 30


def test_the_cache_gets_the_fraction_less_what_is_in_use_and_twice_the_step() -> None:
    gib, how = kv_cache_budget(utilization=0.9, free=100 * GIB, total=140 * GIB,
                               step_peak=GIB)
    assert gib == pytest.approx(0.9 * 140 - 40 - 2 - OVERHEAD_BYTES / GIB)
    assert "--gpu-memory-utilization 0.9 of 140.0 GiB, 40.00 GiB already in use" in how
    assert how.endswith(f"{gib:.2f} GiB for the KV cache")


def test_without_a_measured_step_a_tenth_is_held_back() -> None:
    gib, how = kv_cache_budget(utilization=0.5, free=70 * GIB, total=80 * GIB,
                               step_peak=None)
    assert gib == pytest.approx(0.9 * 30 - OVERHEAD_BYTES / GIB)
    assert "10% held back under tensor parallelism" in how


def test_a_fraction_that_leaves_nothing_says_what_to_change() -> None:
    with pytest.raises(ValidationError, match="nothing is left for the KV cache. Raise "
                                              "--gpu-memory-utilization") as info:
        kv_cache_budget(utilization=0.3, free=50 * GIB, total=80 * GIB, step_peak=GIB)
    assert "30.00 GiB already in use" in str(info.value)
    assert info.value.param == "gpu_memory_utilization"
