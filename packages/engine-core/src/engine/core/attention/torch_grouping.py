"""Batch layout of the torch attention backend: requests grouped, padded, masked.

A step mixes requests with one query token (decode) and many (prefill chunks). Each group
of requests is padded to its longest query and longest context, so one batched
``scaled_dot_product_attention`` call per group and layer does all of them::

    group of n requests, queries padded to Q, contexts padded to L = nb * block_size

    q_index  [n, Q]      token row of each query slot (padding points at row 0)
    blocks   [n, nb]     each request's KV blocks (padding: block 0, masked out)
    mask     [n, 1, Q, L] key j visible to query i  <=>  j <= position(i)
                          and j > position(i) - sliding_window (when set)

With ``G`` query heads per KV head and ``Q > 1``, the mask has ``G * Q`` rows (row
``g * Q + i`` is query ``i``'s), the layout of the backend's folded queries; built once
per step, not per layer.

A decode group whose requests all have the same context length ``kv_len`` (and no sliding
window) needs no mask: its keys are cut to ``kv_len`` and attention runs unmasked (torch's
fastest CPU path); ``mask`` is then None.

Decode requests form one group (Q = 1). Prefill requests are sorted by query length and cut
into groups whose padding stays below the tokens they hold, so one long prompt never pads
many short chunks. The layout is built once per step and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class AttentionGroup:
    """Requests attended together (see the module docstring for shapes)."""

    q_index: torch.Tensor
    out_rows: torch.Tensor
    out_positions: torch.Tensor
    block_ids: torch.Tensor
    mask: torch.Tensor | None
    kv_len: int | None = None


def split_prefills(query_lens: np.ndarray, request_ids: np.ndarray) -> list[np.ndarray]:
    """Cut prefill requests (sorted by query length) into groups with bounded padding."""
    order = request_ids[np.argsort(query_lens[request_ids], kind="stable")]
    groups: list[np.ndarray] = []
    start = 0
    for end in range(1, len(order) + 1):
        if end == len(order):
            groups.append(order[start:end])
            break
        lens = query_lens[order[start:end + 1]]
        # Longest query is the next one; keep it only if padding stays <= real tokens.
        if int(lens[-1]) * len(lens) > 2 * int(lens.sum()):
            groups.append(order[start:end])
            start = end
    return groups


def build_group(
    reqs: np.ndarray, query_start: np.ndarray, query_lens: np.ndarray, seq_lens: np.ndarray,
    block_table: torch.Tensor, block_size: int, sliding_window: int | None,
    queries_per_kv_head: int = 1,
) -> AttentionGroup:
    """The padded layout of one group of requests (indices into the step's requests)."""
    qlens = query_lens[reqs]
    slens = seq_lens[reqs]
    max_q = int(qlens.max())
    num_blocks = int(-(-int(slens.max()) // block_size))
    block_ids = block_table[torch.from_numpy(reqs.astype(np.int64)), :num_blocks].long()
    if max_q == 1 and sliding_window is None and int(slens.min()) == int(slens.max()):
        rows = torch.from_numpy(query_start[reqs].astype(np.int64))
        return AttentionGroup(q_index=rows.view(-1, 1), out_rows=rows,
                              out_positions=torch.arange(len(reqs)), block_ids=block_ids,
                              mask=None, kv_len=int(slens[0]))
    offsets = np.arange(max_q)
    valid_q = offsets[None, :] < qlens[:, None]                        # [n, Q]
    q_index = np.where(valid_q, query_start[reqs][:, None] + offsets[None, :], 0)
    positions = (slens - qlens)[:, None] + offsets[None, :]            # [n, Q]
    keys = np.arange(num_blocks * block_size)
    mask = keys[None, None, :] <= positions[:, :, None]                # [n, Q, L]
    if sliding_window is not None:
        mask &= keys[None, None, :] > positions[:, :, None] - sliding_window
    mask[~valid_q] = False
    mask[~valid_q, 0] = True  # padding rows see one key: finite softmax, output discarded
    if max_q > 1 and queries_per_kv_head > 1:  # one decode row broadcasts over the heads
        mask = np.tile(mask, (1, queries_per_kv_head, 1))
    flat_valid = valid_q.reshape(-1)
    return AttentionGroup(
        q_index=torch.from_numpy(q_index.astype(np.int64)),
        out_rows=torch.from_numpy(q_index.reshape(-1)[flat_valid].astype(np.int64)),
        out_positions=torch.from_numpy(np.flatnonzero(flat_valid).astype(np.int64)),
        block_ids=block_ids,
        mask=torch.from_numpy(mask).unsqueeze(1),
    )


def build_groups(
    query_start: np.ndarray, seq_lens: np.ndarray, block_table: torch.Tensor, block_size: int,
    sliding_window: int | None, queries_per_kv_head: int = 1,
) -> tuple[AttentionGroup, ...]:
    """All groups of a step: decodes together, prefills in bounded-padding groups."""
    query_lens = np.diff(query_start)
    all_reqs = np.arange(len(query_lens))
    decodes = all_reqs[query_lens == 1]
    prefills = all_reqs[query_lens > 1]
    batches = ([decodes] if len(decodes) else []) + (
        split_prefills(query_lens, prefills) if len(prefills) else [])
    return tuple(
        build_group(reqs, query_start, query_lens, seq_lens, block_table, block_size,
                    sliding_window, queries_per_kv_head)
        for reqs in batches
    )
