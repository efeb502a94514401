"""Faulting in the first blocks of a fresh CPU KV cache, on a background thread.

``kv_cache.zeroed`` leaves the cache's pages untouched, so start-up does not pay for memory
no request may ever use. The first write to each page then pays instead, inside a step:
on a VM, first-touched memory comes at ~1 GB/s (the host backs every page), so the first
burst of traffic after start stalled in ``write_kv`` (~2 ms of a 45 ms decode step of 64
requests on the benchmark model, 3-4% of the first minute's throughput).

The pool hands blocks out lowest id first (``BlockPool``: never-used blocks are queued in
id order), so once the worker has warmed up and captured its step graph (whose kernels the
faults would slow down: ``Worker.prefault_kv_cache``) a daemon thread asks the kernel to fault in
blocks ``0 .. n`` of every layer in that order (``madvise(MADV_POPULATE_WRITE)``, Linux
5.14+; elsewhere it does nothing), up to ``PREFAULT_BYTES`` in all. It holds no GIL while
the kernel works and runs while the server starts (0.1 s on 4 KiB pages, 0.3-0.6 s on the
huge pages EngineCore's ``malloc`` asks for, on the 2-core development VM); a block that
traffic reaches first is simply already there. The resident memory grows by that budget
right after start instead of with the first requests.
"""

from __future__ import annotations

import ctypes
import logging
import math
import threading

import torch

logger = logging.getLogger(__name__)

#: Bytes of KV cache (all layers together) faulted in after allocation.
PREFAULT_BYTES = 256 << 20
#: Blocks per ``madvise`` call: the lowest ids come first and ``stop`` is checked between.
CHUNK_BLOCKS = 16
MADV_POPULATE_WRITE = 23  # linux/mman.h
PAGE = 4096


def block_ranges(cache: torch.Tensor, num_blocks: int) -> list[tuple[int, int]]:
    """``(address of block 0, bytes per block)`` of each run of blocks in ``cache``.

    The block axis is the first of size ``num_blocks`` (``[2, blocks, ...]`` for the
    built-in backends: a run for the keys and one for the values). Empty when the cache
    is not a contiguous CPU tensor with such an axis (nothing is faulted in then).
    """
    if cache.device.type != "cpu" or not cache.is_contiguous():
        return []
    axis = next((d for d, size in enumerate(cache.shape) if size == num_blocks), None)
    if axis is None:
        return []
    size = cache.element_size()
    block = cache.stride(axis) * size
    run = num_blocks * block
    return [(cache.data_ptr() + i * run, block) for i in range(math.prod(cache.shape[:axis]))]


class KVPrefault:
    """The background thread (see the module docstring); ``stop()`` ends it early."""

    def __init__(self, caches: dict[str, torch.Tensor], num_blocks: int,
                 budget: int = PREFAULT_BYTES) -> None:
        self._ranges = [r for cache in caches.values() for r in block_ranges(cache, num_blocks)]
        per_block = sum(block for _, block in self._ranges)
        self.blocks = min(num_blocks, budget // per_block) if per_block else 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-kv-prefault",
                                        daemon=True)
        if self.blocks:
            self._thread.start()

    def _run(self) -> None:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        for first in range(0, self.blocks, CHUNK_BLOCKS):
            count = min(CHUNK_BLOCKS, self.blocks - first)
            for base, block in self._ranges:
                if self._stop.is_set():
                    return
                start = base + first * block
                aligned = start - start % PAGE
                if madvise(aligned, start + count * block - aligned, MADV_POPULATE_WRITE):
                    logger.debug("KV cache pre-fault stopped: madvise errno %d (needs Linux "
                                 "5.14+)", ctypes.get_errno())
                    return

    def join(self, timeout: float | None = None) -> None:
        """Wait for the thread (tests, and ``stop``)."""
        if self._thread.is_alive():
            self._thread.join(timeout)

    def stop(self) -> None:
        """End the thread after its current call (shutdown)."""
        self._stop.set()
        self.join()
