"""Torch references of the paged-attention kernels (same arguments, plain torch, float32).

Slow and simple on purpose (a Python loop per request): the oracle the Triton kernels are
checked against, in the cache layout of ``paged_kernels``.
"""

from __future__ import annotations

import torch

from engine.kernels.attention.batch import PagedBatch


def reshape_and_cache_reference(key: torch.Tensor, value: torch.Tensor,
                                key_cache: torch.Tensor, value_cache: torch.Tensor,
                                slot_mapping: torch.Tensor) -> None:
    """What ``paged_kernels.reshape_and_cache`` does: row ``i`` to slot ``slot_mapping[i]``."""
    block_size = key_cache.shape[1]
    slots = slot_mapping.long()
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key
    value_cache[blocks, offsets] = value


def paged_attention_reference(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    batch: PagedBatch, *, scale: float, sliding_window: int | None,
) -> torch.Tensor:
    """What ``paged_kernels.paged_attention`` computes, returned (``[rows, heads, size]``).

    Each request's keys and values are gathered from its blocks, repeated per query head,
    and attended with a causal (and sliding-window) mask in float32; rows past the last
    request are zero.
    """
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    block_size = key_cache.shape[1]
    group = query.shape[1] // key_cache.shape[2]
    starts = batch.query_start_loc.tolist()
    for i in range(batch.num_reqs):
        seq_len = int(batch.seq_lens[i])
        q = query[starts[i]:starts[i + 1]].float()
        blocks = batch.block_table[i, : -(-seq_len // block_size)].long()
        k = key_cache[blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(group, 1)
        v = value_cache[blocks].flatten(0, 1)[:seq_len].float().repeat_interleave(group, 1)
        positions = torch.arange(seq_len - q.shape[0], seq_len, device=query.device)
        keys = torch.arange(seq_len, device=query.device)
        visible = keys[None, :] <= positions[:, None]
        if sliding_window is not None:
            visible &= keys[None, :] > positions[:, None] - sliding_window
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        out[starts[i]:starts[i + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out
