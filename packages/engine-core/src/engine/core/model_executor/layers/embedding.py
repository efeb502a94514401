"""``VocabEmbedding``: token ids to vectors; also the tied LM head's weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    """An embedding table ``[vocab_size, hidden_size]``.

    Args:
        vocab_size: Rows of the table.
        hidden_size: Width of each row.
        dtype: Parameter dtype.
        prefix: Checkpoint name of the layer.
    """

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype),
                                   requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def load_weight(self, param_name: str, tensor: torch.Tensor, shard: int | None) -> None:
        """Copy the checkpoint's table (its vocabulary may be padded: extra rows stay 0)."""
        if param_name != "weight" or shard is not None:
            raise ValueError(f"{self.prefix} has only an unsharded 'weight' to load")
        rows = min(tensor.shape[0], self.weight.shape[0])
        if tensor.shape[1:] != self.weight.shape[1:]:
            raise ValueError(
                f"checkpoint tensor for {self.prefix}.weight has shape {tuple(tensor.shape)}, "
                f"the layer expects {tuple(self.weight.shape)}"
            )
        self.weight.data[:rows].copy_(tensor[:rows])
