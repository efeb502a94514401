"""``PagedBatch``: one step's batch layout as the paged-attention kernels read it.

No triton here: the backend builds it on any host, the kernels and references take it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedBatch:
    """The step's layout (the engine's device tensors, never copied).

    Attributes:
        query_start_loc: ``[num_reqs + 1]`` int32 cumulative query lengths.
        seq_lens: ``[num_reqs]`` int32 context lengths after the step.
        block_table: ``[num_reqs, max_blocks]`` int32 block ids per request.
        slot_mapping: ``[num_tokens]`` int64 cache slot of each row (padding rows: slots of
            the null block).
        num_reqs: Requests in the step (sizes the attention grid).
        num_actual_tokens: Real rows of the step.
        max_query_len: Longest query of the step (1: a decode-only batch).
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int

    @property
    def is_decode_only(self) -> bool:
        """Every request has one query token (the kernels' small-tile configuration)."""
        return self.max_query_len == 1
