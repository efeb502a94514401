"""``--gpu-memory-utilization`` on CUDA: the KV cache takes what that fraction leaves.

The worker, after loading its weights and before allocating the cache, measures what one
step of ``max_num_batched_tokens`` tokens needs beyond the weights (``profile_step_peak``:
a forward pass over the null block alone, the LM head over ``max_num_seqs`` rows and the
sampler's float32 copy of them), then gives the KV cache::

    utilization x total  -  (total - free)  -  2 x step peak  -  OVERHEAD_BYTES

``total - free`` is everything on the GPU at that point: this process's weights and CUDA
context, and any other process's memory. Twice the step peak covers the step's own
buffers and the CUDA graphs' memory pool (decode batches, smaller than that step);
``OVERHEAD_BYTES`` covers library workspaces allocated on first use (cuBLAS, Triton).

Under tensor parallelism the ranks' passes would run collectives in lockstep, which a
failing rank would hang: there the step peak is not measured and ``TP_RESERVE_FRACTION``
of the budget is held back instead.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from engine.core.worker.kv_cache import GIB, allocate_kv_cache
from engine.core.worker.step_inputs import build_step_inputs
from engine.sdk.errors import ValidationError

#: Library workspaces and allocator slack, beyond the measured step.
OVERHEAD_BYTES = 512 << 20
#: Held back from the budget when the step peak is not measured (tensor parallelism).
TP_RESERVE_FRACTION = 0.1


def kv_cache_budget(*, utilization: float, free: int, total: int,
                    step_peak: int | None) -> tuple[float, str]:
    """GiB for the KV cache, and a line saying how they were found.

    Raises:
        ValidationError: nothing would be left for the KV cache.
    """
    allowed = utilization * total
    in_use = total - free
    if step_peak is None:
        reserve = TP_RESERVE_FRACTION * max(0.0, allowed - in_use) + OVERHEAD_BYTES
        how = f"{TP_RESERVE_FRACTION:.0%} held back under tensor parallelism"
    else:
        reserve = 2 * step_peak + OVERHEAD_BYTES
        how = f"2 x {step_peak / GIB:.2f} GiB measured for one step"
    budget = allowed - in_use - reserve
    summary = (f"--gpu-memory-utilization {utilization:g} of {total / GIB:.1f} GiB, "
               f"{in_use / GIB:.2f} GiB already in use (weights, CUDA context, other "
               f"processes), {reserve / GIB:.2f} GiB kept for activations ({how}, plus "
               f"{OVERHEAD_BYTES >> 20} MiB)")
    if budget <= 0:
        raise ValidationError(
            f"{summary}: nothing is left for the KV cache. Raise --gpu-memory-utilization, "
            f"lower --max-num-batched-tokens or --max-num-seqs, or give --kv-cache-memory "
            f"GiB or --num-kv-blocks N instead.", param="gpu_memory_utilization")
    return budget / GIB, f"{summary}: {budget / GIB:.2f} GiB for the KV cache"


def profile_step_peak(model: Any, builder: Any, layers: dict[str, Any], backend: Any, *,
                      tokens: int, rows: int, max_model_len: int, block_size: int,
                      dtype: torch.dtype, device: torch.device) -> int:
    """Bytes a step of ``tokens`` prompt tokens allocates on ``device`` beyond the weights.

    Prompts of ``max_model_len`` tokens (the last one shorter) whose every slot and block
    is the null block (a cache of that block alone, dropped afterwards), then
    ``compute_logits`` over ``rows`` hidden states and a float32 softmax of them (the
    sampler's copy).
    """
    caches = allocate_kv_cache(layers, backend, 1, block_size, dtype, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    full, rest = divmod(tokens, max_model_len)
    lengths = np.array([max_model_len] * full + ([rest] if rest else []), dtype=np.int32)
    longest = int(lengths.max())
    inputs = build_step_inputs(
        num_scheduled=lengths, num_computed=np.zeros_like(lengths), num_tokens=lengths,
        token_ids=np.zeros((len(lengths), longest), dtype=np.int32),
        block_table=np.zeros((len(lengths), math.ceil(longest / block_size)), dtype=np.int32),
        block_size=block_size, device=device)
    with torch.inference_mode():
        hidden = model(inputs.input_ids, inputs.positions, builder.build(inputs.common))
        logits = model.compute_logits(hidden[-min(rows, tokens):])
        torch.softmax(logits.float(), dim=-1)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del hidden, logits, inputs
    caches.clear()
    for layer in layers.values():
        layer.kv_cache = None
    torch.cuda.empty_cache()
    return int(peak)


__all__ = ["OVERHEAD_BYTES", "kv_cache_budget", "profile_step_peak"]
