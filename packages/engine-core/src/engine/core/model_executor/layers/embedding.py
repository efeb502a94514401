"""``VocabEmbedding``: token ids to vectors; also the tied LM head's weight.

Under tensor parallelism the table is split by rows (``distributed.vocab_slice``): each
rank holds ``ceil(vocab / tp)`` contiguous rows (padding rows past the vocabulary stay
zero), looks up the ids it holds, writes zeros for the others, and the ranks' results are
summed, so every rank ends with the full embeddings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.core.distributed import SINGLE, TensorParallelGroup, all_reduce, vocab_slice


class VocabEmbedding(nn.Module):
    """An embedding table ``[vocab_size, hidden_size]`` (this rank's rows of it).

    Args:
        vocab_size: Rows of the whole table.
        hidden_size: Width of each row.
        dtype: Parameter dtype.
        prefix: Checkpoint name of the layer.
        tp: The tensor-parallel group the rows are split across.
    """

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, prefix: str,
                 tp: TensorParallelGroup = SINGLE) -> None:
        super().__init__()
        self.prefix = prefix
        self.vocab_size = vocab_size
        self.tp = tp
        self.rows = vocab_slice(vocab_size, tp.rank, tp.size)
        self.weight = nn.Parameter(torch.zeros(self.rows.size, hidden_size, dtype=dtype),
                                   requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.is_parallel:
            return F.embedding(input_ids, self.weight)
        start = self.rows.start
        held = (input_ids >= start) & (input_ids < start + self.rows.size)
        out = F.embedding(torch.where(held, input_ids - start, 0), self.weight)
        out.masked_fill_(~held.unsqueeze(-1), 0)
        return all_reduce(out, self.tp)

    def load_weight(self, param_name: str, tensor: torch.Tensor, shard: int | None) -> None:
        """Copy this rank's rows of the checkpoint's full table.

        The checkpoint's vocabulary may differ from the config's: rows the checkpoint lacks
        stay 0, rows past the config's vocabulary are ignored.
        """
        if param_name != "weight" or shard is not None:
            raise ValueError(f"{self.prefix} has only an unsharded 'weight' to load")
        if tensor.shape[1:] != self.weight.shape[1:]:
            raise ValueError(
                f"checkpoint tensor for {self.prefix}.weight has shape {tuple(tensor.shape)}, "
                f"the layer expects {(self.vocab_size, *self.weight.shape[1:])}"
            )
        end = min(tensor.shape[0], self.vocab_size)
        rows = max(0, min(self.rows.size, end - self.rows.start))
        if rows:
            self.weight.data[:rows].copy_(tensor.narrow(0, self.rows.start, rows))
        self.weight.data[rows:].zero_()
