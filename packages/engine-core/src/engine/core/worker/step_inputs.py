"""Flatten one step's scheduled tokens into model inputs, vectorised over the batch.

For requests ``0 .. n-1`` (batch slot order) with ``num_scheduled[i]`` tokens starting at
``num_computed[i]``::

    tokens  |-- req 0 --|- req 1 -|------ req 2 ------|
    position  c0 .. c0+s0-1  c1 ..   c2 ..
    slot      block_table[req, pos // block_size] * block_size + pos % block_size

``logits_indices`` picks each request's last scheduled token; a request whose sequence is
not complete after this step (a chunk of a long prompt) is "partial": its sample is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.sdk.attention import CommonAttentionMetadata


@dataclass(frozen=True)
class StepInputs:
    """Model inputs and bookkeeping of one step."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    common: CommonAttentionMetadata
    logits_indices: torch.Tensor
    is_partial: np.ndarray
    query_start: np.ndarray
    num_computed: np.ndarray


def build_step_inputs(
    *, num_scheduled: np.ndarray, num_computed: np.ndarray, num_tokens: np.ndarray,
    token_ids: np.ndarray, block_table: np.ndarray, block_size: int, device: torch.device,
) -> StepInputs:
    """Inputs for ``n = len(num_scheduled)`` requests (arrays indexed by batch slot)."""
    n = len(num_scheduled)
    cu = np.cumsum(num_scheduled, dtype=np.int64)
    total = int(cu[-1])
    req_of_token = np.repeat(np.arange(n), num_scheduled)
    offsets = np.arange(total, dtype=np.int64) - np.repeat(cu - num_scheduled, num_scheduled)
    positions = num_computed[req_of_token].astype(np.int64) + offsets
    input_ids = token_ids[req_of_token, positions]
    blocks = block_table[req_of_token, positions // block_size].astype(np.int64)
    slot_mapping = blocks * block_size + positions % block_size
    seq_lens = (num_computed + num_scheduled).astype(np.int32)
    query_start = np.zeros(n + 1, dtype=np.int32)
    query_start[1:] = cu
    max_blocks = int(-(-int(seq_lens.max()) // block_size))
    query_start_cpu = torch.from_numpy(query_start)
    seq_lens_cpu = torch.from_numpy(seq_lens)
    common = CommonAttentionMetadata(
        query_start_loc=query_start_cpu.to(device),
        query_start_loc_cpu=query_start_cpu,
        seq_lens=seq_lens_cpu.to(device),
        seq_lens_cpu=seq_lens_cpu,
        block_table=torch.from_numpy(np.ascontiguousarray(block_table[:, :max_blocks])).to(device),
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        num_reqs=n,
        num_actual_tokens=total,
        max_query_len=int(num_scheduled.max()),
        max_seq_len=int(seq_lens.max()),
    )
    return StepInputs(
        input_ids=torch.from_numpy(input_ids.astype(np.int64)).to(device),
        positions=torch.from_numpy(positions).to(device),
        common=common,
        logits_indices=torch.from_numpy(cu - 1).to(device),
        is_partial=seq_lens < num_tokens,
        query_start=query_start,
        num_computed=num_computed.copy(),
    )
