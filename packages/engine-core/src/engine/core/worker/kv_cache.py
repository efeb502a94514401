"""Sizing and allocating the paged KV cache.

Every attention layer gets one tensor shaped by its backend's ``get_kv_cache_shape``;
block ``b`` of every layer together holds the keys and values of the same ``block_size``
tokens. Block 0 is the null block: never given to a request, it is where padding reads
and writes land.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from engine.core.model_executor.layers import Attention
from engine.sdk.attention import AttentionBackend
from engine.sdk.errors import ValidationError

GIB = 1 << 30
#: KV memory on the CPU when the operator gives neither --num-kv-blocks nor --kv-cache-memory.
DEFAULT_CPU_KV_CACHE_GIB = 2.0
HUGE_PAGE, CACHE_LINE = 2 << 20, 64


def bytes_per_block(
    layers: dict[str, Attention], backend: type[AttentionBackend], block_size: int,
    dtype: torch.dtype,
) -> int:
    """Bytes one block takes across every attention layer."""
    element = dtype.itemsize
    total = 0
    for layer in layers.values():
        shape = backend.get_kv_cache_shape(1, block_size, layer.num_kv_heads, layer.head_size)
        total += math.prod(shape) * element
    return total


def num_blocks_for(
    *, num_kv_blocks: int | None, kv_cache_memory: float | None, block_bytes: int,
    block_size: int, max_model_len: int, max_num_seqs: int,
) -> int:
    """Blocks to allocate: the usable blocks plus the null block.

    ``num_kv_blocks`` counts usable blocks (what requests can hold); memory sizing
    includes the null block.

    Raises:
        ValidationError: the cache cannot hold one sequence of ``max_model_len`` tokens.
    """
    blocks_per_seq = math.ceil(max_model_len / block_size)
    if num_kv_blocks is not None:
        usable = num_kv_blocks
        source = f"--num-kv-blocks {num_kv_blocks}"
    else:
        gib = kv_cache_memory if kv_cache_memory is not None else DEFAULT_CPU_KV_CACHE_GIB
        usable = int(gib * GIB // block_bytes) - 1
        if kv_cache_memory is None:  # default: no more than the batch can ever use
            usable = min(usable, blocks_per_seq * max_num_seqs)
        source = f"--kv-cache-memory {gib:g} GiB ({block_bytes} bytes per block)"
    if usable < blocks_per_seq:
        raise ValidationError(
            f"the KV cache ({source}) holds {max(usable, 0) * block_size} tokens, fewer than "
            f"one sequence of max_model_len={max_model_len} tokens needs "
            f"({blocks_per_seq} blocks of {block_size}). Raise --kv-cache-memory or "
            f"--num-kv-blocks, or lower --max-model-len.",
            param="kv_cache_memory" if num_kv_blocks is None else "num_kv_blocks",
        )
    return usable + 1


def allocate_kv_cache(
    layers: dict[str, Attention], backend: type[AttentionBackend], num_blocks: int,
    block_size: int, dtype: torch.dtype, device: torch.device,
) -> dict[str, torch.Tensor]:
    """One zeroed cache tensor per layer, bound to the layer; returns name -> tensor."""
    caches = {}
    for name, layer in layers.items():
        shape = backend.get_kv_cache_shape(num_blocks, block_size, layer.num_kv_heads,
                                           layer.head_size)
        caches[name] = layer.kv_cache = zeroed(tuple(shape), dtype, device)
    return caches


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on the CPU without writing it now, and aligned for the kernels.

    ``torch.zeros`` writes every byte (2 GiB of KV cache: ~0.8 s of start-up here). On the
    CPU the memory comes from ``calloc`` (through numpy) instead: a large block is fresh
    zero pages from the OS, touched only when first written; a small one is cleared by
    ``calloc``. Either way every element reads as zero.

    The data starts on a 2 MiB boundary (a huge page's) when the tensor is that large, on
    a cache line's otherwise: ``calloc`` alone puts it 16 bytes past a page boundary, so
    that each 128-byte key row of a block straddled three cache lines instead of two and
    every vector load of the attention kernel was split.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    align = HUGE_PAGE if nbytes >= HUGE_PAGE else CACHE_LINE
    raw = np.zeros(nbytes + align, dtype=np.uint8)
    start = -raw.ctypes.data % align
    return torch.from_numpy(raw[start:start + nbytes]).view(dtype).view(shape)
