"""The three collectives tensor parallelism needs; each is a no-op for a single rank.

With one rank nothing here calls ``torch.distributed``, so a worker without a process
group runs the same code at no extra cost.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.core.distributed.group import TensorParallelGroup


def all_reduce(tensor: torch.Tensor, group: TensorParallelGroup) -> torch.Tensor:
    """Sum ``tensor`` over the ranks, in place; returns it."""
    if group.is_parallel:
        dist.all_reduce(tensor, group=group.process_group)
    return tensor


def gather_to_driver(tensor: torch.Tensor, group: TensorParallelGroup) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along the last dim, on rank 0.

    Every rank passes a tensor of the same shape. Returns the concatenation (rank order)
    on rank 0; on the other ranks their own ``tensor``, unchanged.
    """
    if not group.is_parallel:
        return tensor
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(group.size)] if group.is_driver else None
    dist.gather(tensor, parts, dst=0, group=group.process_group)
    return torch.cat(parts, dim=-1) if parts is not None else tensor


def broadcast_from_driver(tensor: torch.Tensor, group: TensorParallelGroup) -> torch.Tensor:
    """Overwrite ``tensor`` on every rank with rank 0's values (same shape everywhere)."""
    if group.is_parallel:
        dist.broadcast(tensor, src=0, group=group.process_group)
    return tensor
