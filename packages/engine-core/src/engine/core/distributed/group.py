"""``TensorParallelGroup``: which rank this worker is among how many, and the group to talk on.

The worker creates one (after ``torch.distributed.init_process_group`` when there is more
than one rank) and hands it to the layer factory and the model runner; layers that
communicate keep a reference. Nothing reads it from a module global.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelGroup:
    """This worker's place in the tensor-parallel group.

    Attributes:
        rank: This worker's rank, ``0 <= rank < size``; rank 0 is the driver.
        size: Number of ranks the model is split across.
        process_group: The ``torch.distributed`` group of the ranks (``None``: the default,
            world group; unused when ``size == 1``).
    """

    rank: int = 0
    size: int = 1
    process_group: Any = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is not in [0, {self.size})")

    @property
    def is_parallel(self) -> bool:
        """True when the model is split across more than one rank."""
        return self.size > 1

    @property
    def is_driver(self) -> bool:
        """True on rank 0, the rank that samples and returns the step's output."""
        return self.rank == 0


#: The group of a worker that runs the whole model alone.
SINGLE = TensorParallelGroup()


def init_tensor_parallel(
    *, backend: str, init_method: str | None, rank: int, world_size: int
) -> tuple[TensorParallelGroup, bool]:
    """Join the ranks' process group (for ``world_size > 1``) and describe it.

    A process group that already exists (made by the caller) is used as it is.

    Args:
        backend: ``torch.distributed`` backend (the platform's ``dist_backend``).
        init_method: Rendezvous address, e.g. ``"tcp://127.0.0.1:29500"`` (``None``:
            ``env://``).
        rank: This worker's rank.
        world_size: Number of ranks.

    Returns:
        The group, and whether this call created the process group (then the caller
        destroys it at shutdown).

    Raises:
        ValueError: ``rank`` is not in ``[0, world_size)``, or an existing process group
            has another size or rank.
    """
    group = TensorParallelGroup(rank, world_size)
    if world_size == 1:
        return group, False
    if dist.is_initialized():
        if (dist.get_world_size(), dist.get_rank()) != (world_size, rank):
            raise ValueError(
                f"a torch.distributed process group already exists with world size "
                f"{dist.get_world_size()} and rank {dist.get_rank()}, but this worker is rank "
                f"{rank} of {world_size}")
        return group, False
    dist.init_process_group(backend=backend, init_method=init_method, rank=rank,
                            world_size=world_size)
    return group, True


def destroy_tensor_parallel(created: bool) -> None:
    """Destroy the default process group if this process created it and it still exists."""
    if created and dist.is_initialized():
        dist.destroy_process_group()
