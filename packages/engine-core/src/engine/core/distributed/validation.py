"""Start-up check that a model can be split across ``tensor_parallel_size`` ranks here."""

from __future__ import annotations

from typing import Any

from engine.core.cpu_threads import this_process
from engine.core.distributed.sharding import heads_divide
from engine.sdk.errors import ValidationError
from engine.sdk.platform import Platform


def available_ranks(platform: type[Platform]) -> tuple[int, str]:
    """How many ranks this host can run (one per device, or per CPU core), and the unit."""
    if platform.device_type == "cpu":
        return this_process().num_cpus, "CPU cores available to this process"
    return platform.device_count(), f"{platform.name} devices"


def working_sizes(num_heads: int, num_kv_heads: int, intermediate_size: int | None) -> list[int]:
    """Every tensor-parallel size the model's shapes allow."""
    return [size for size in range(1, num_heads + 1)
            if num_heads % size == 0 and heads_divide(num_kv_heads, size)
            and (intermediate_size is None or intermediate_size % size == 0)]


def check_tensor_parallel(hf_config: Any, tp_size: int, platform: type[Platform]) -> None:
    """Refuse a ``tensor_parallel_size`` the model or the host cannot serve, before loading.

    The model's query heads and MLP width must divide by ``tp_size``; its KV heads must
    divide by it or divide it (then each rank holds one, replicated); the host needs one
    CPU core (CPU platform) or one device per rank.

    Raises:
        ValidationError: ``param="tensor_parallel_size"``, with the numbers and the sizes
            that would work.
    """
    if tp_size == 1:
        return
    num_heads = int(hf_config.num_attention_heads)
    num_kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or num_heads)
    intermediate = getattr(hf_config, "intermediate_size", None)
    intermediate = int(intermediate) if intermediate else None
    capacity, unit = available_ranks(platform)
    sizes = working_sizes(num_heads, num_kv_heads, intermediate)
    fitting = [s for s in sizes if s <= capacity]
    choices = (f"sizes that divide this model: {', '.join(map(str, sizes))} (of which "
               f"{', '.join(map(str, fitting)) or 'none'} fit the {capacity} {unit})")
    problem = None
    if num_heads % tp_size:
        problem = (f"tensor_parallel_size {tp_size} does not divide the model's {num_heads} "
                   f"attention heads (and {num_kv_heads} KV heads)")
    elif not heads_divide(num_kv_heads, tp_size):
        problem = (f"tensor_parallel_size {tp_size} neither divides the model's "
                   f"{num_kv_heads} KV heads nor is a multiple of them (each rank must hold "
                   f"a share of the KV heads, or one replicated KV head)")
    elif intermediate is not None and intermediate % tp_size:
        problem = (f"tensor_parallel_size {tp_size} does not divide the model's MLP "
                   f"intermediate_size {intermediate}")
    elif tp_size > capacity:
        problem = (f"tensor_parallel_size {tp_size} needs {tp_size} ranks, one per "
                   f"{'core' if platform.device_type == 'cpu' else 'device'}, but there "
                   f"are {capacity} {unit}")
    if problem is not None:
        raise ValidationError(f"{problem}; {choices}", param="tensor_parallel_size")
