"""The workers' KV-cache tensors on the CPU: zero, writable throughout, aligned for the kernels."""

from __future__ import annotations

import pytest
import torch

from engine.core.worker.kv_cache import CACHE_LINE, HUGE_PAGE, zeroed


@pytest.mark.parametrize(("shape", "dtype", "align"), [
    ((3, 5), torch.float32, CACHE_LINE),  # small: calloc clears it, a cache line's alignment
    ((2, 9, 4, 16, 64), torch.bfloat16, CACHE_LINE),  # ~144 KiB
    ((2, 300, 4, 16, 64), torch.bfloat16, HUGE_PAGE),  # ~4.7 MiB: fresh pages, huge-page start
])
def test_cpu_cache_is_zero_and_aligned(shape: tuple[int, ...], dtype: torch.dtype,
                                       align: int) -> None:
    cache = zeroed(shape, dtype, torch.device("cpu"))
    assert cache.shape == shape and cache.dtype == dtype and cache.is_contiguous()
    assert cache.data_ptr() % align == 0  # calloc alone starts 16 bytes past a boundary
    assert not cache.any()
    cache.view(-1)[-1] = 1  # the whole tensor is writable (the alignment took nothing off)
    assert cache.view(-1)[-1] == 1 and cache.sum() == 1
