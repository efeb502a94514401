"""The KV cache's first blocks are faulted in by a background thread, lowest ids first."""

from __future__ import annotations

import ctypes
import math
import mmap
import sys

import pytest
import torch

from engine.core.worker.kv_prefault import PAGE, KVPrefault, block_ranges

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="madvise/mincore are Linux's")
BLOCKS, BLOCK_SHAPE = 2048, (4, 16, 64)  # 8 KiB of bfloat16 per block and half (keys, values)
_MAPPINGS: list[mmap.mmap] = []  # the test caches' memory, kept mapped for the session


def resident(address: int, length: int) -> list[bool]:
    """Per page of ``[address, address + length)``: whether it is in memory (mincore)."""
    start = address - address % PAGE
    pages = -(-(address + length - start) // PAGE)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(start, pages * PAGE, vec) == 0, ctypes.get_errno()
    return [bool(v & 1) for v in vec]


def fresh_cache() -> torch.Tensor:
    """A cache on pages nothing has touched: its own anonymous mapping (the allocator
    behind ``kv_cache.zeroed`` may hand out heap memory that is already resident)."""
    shape = (2, BLOCKS, *BLOCK_SHAPE)
    mapping = mmap.mmap(-1, math.prod(shape) * 2)
    _MAPPINGS.append(mapping)
    return torch.frombuffer(mapping, dtype=torch.bfloat16).view(shape)


def test_block_ranges_are_the_key_and_value_runs() -> None:
    cache = fresh_cache()
    block = 4 * 16 * 64 * 2
    assert block_ranges(cache, BLOCKS) == [(cache.data_ptr(), block),
                                           (cache.data_ptr() + BLOCKS * block, block)]
    assert block_ranges(cache.transpose(0, 1), BLOCKS) == []  # not contiguous: left alone
    assert block_ranges(cache, BLOCKS + 1) == []  # no block axis: left alone


def test_the_first_blocks_of_every_layer_are_resident_the_rest_not() -> None:
    caches = {"a": fresh_cache(), "b": fresh_cache()}
    block = 4 * 16 * 64 * 2
    prefault = KVPrefault(caches, BLOCKS, budget=4 * 8 * block)  # 4 runs x 8 blocks
    prefault.join(timeout=30)
    assert prefault.blocks == 8
    for cache in caches.values():
        for base, size in block_ranges(cache, BLOCKS):
            assert all(resident(base, 8 * size))
            # Never written and more than a huge page away (THP): not faulted in.
            assert not any(resident(base + BLOCKS // 2 * size, BLOCKS // 2 * size))
    assert all(cache.count_nonzero() == 0 for cache in caches.values())  # still zeros


def test_stop_ends_the_thread_and_no_budget_starts_none() -> None:
    prefault = KVPrefault({"a": fresh_cache()}, BLOCKS)
    prefault.stop()
    assert not prefault._thread.is_alive()
    assert KVPrefault({"a": fresh_cache()}, BLOCKS, budget=0).blocks == 0
