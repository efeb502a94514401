"""Tensor parallelism between workers: the group, its collectives, sharding and checks."""

from engine.core.distributed.collectives import (
    all_reduce,
    broadcast_from_driver,
    gather_to_driver,
)
from engine.core.distributed.group import (
    SINGLE,
    TensorParallelGroup,
    destroy_tensor_parallel,
    init_tensor_parallel,
)
from engine.core.distributed.sharding import (
    Slice,
    even_slice,
    head_slice,
    heads_divide,
    vocab_slice,
)
from engine.core.distributed.validation import available_ranks, check_tensor_parallel

__all__ = [
    # the group
    "SINGLE",
    "TensorParallelGroup",
    "init_tensor_parallel",
    "destroy_tensor_parallel",
    # collectives
    "all_reduce",
    "broadcast_from_driver",
    "gather_to_driver",
    # sharding
    "Slice",
    "even_slice",
    "head_slice",
    "heads_divide",
    "vocab_slice",
    # start-up checks
    "available_ranks",
    "check_tensor_parallel",
]
