"""Time linear kernels on one layer shape at each row bucket's row count.

Each candidate processes the same synthetic weights (random, of the layer's shape and
dtype; float32 ones hold bfloat16 values, as a bfloat16 checkpoint run in float32 does)
and multiplies them, cycling through enough copies that the weights come from memory as
in a forward pass (a weight that stays in the caches flatters small steps). The
candidates take turns, three rounds, and each keeps its best round (the least disturbed by
other work on the machine). A candidate that raises, or whose product is not the
reference's, is left out with the reason.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine.core.kernel_choice.buckets import RowBucket
from engine.core.plugin_faults import describe
from engine.sdk.linear_kernel import LinearKernel, LinearKernelConfig

#: Rounds each candidate is timed in (its best counts).
ROUNDS = 3
#: A candidate this many times slower than the best after a round is not timed further.
DROP_FACTOR = 3.0
#: Buckets of more rows than this are bound by compute: two weight copies suffice.
STREAMED_ROWS = 64
#: The weight copies cycled through hold this many times a core's own cache, within
#: bounds on their number and bytes.
CACHE_MULTIPLE = 4
MAX_COPIES = 16
MAX_COPY_BYTES = 256 << 20
#: Relative error a product may show against float32 ``F.linear`` (bfloat16: 8 bits of
#: mantissa, summed in another order).
TOLERANCE = {"float32": 1e-3, "bfloat16": 3e-2, "float16": 1e-2}


@dataclass(frozen=True)
class Timing:
    """A candidate's seconds per product in each bucket.

    A candidate dropped as far slower keeps the time of the rounds it ran.
    """

    name: str
    seconds: tuple[float, ...]
    #: Per bucket, its second-best round over its best (1.0: steady; much more: the
    #: machine was busy with other work while it was timed). 1.0 where timed once.
    spread: tuple[float, ...]
    #: Its ``process_weights_after_loading`` left the layer's parameters as they were
    #: (the same tensors, the same values), so it can share a layer with another kernel.
    keeps_layer: bool


class _Layer(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)


def core_cache_bytes() -> int:
    """The largest cache private to a core (sysfs: a level-2 cache is), else 2 MiB.

    Not the last level: a model's weights rarely fit that, and a VM may report the whole
    socket's.
    """
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        if level <= 2 and text[:-1].isdigit() and text[-1] in units:
            sizes.append(int(text[:-1]) * units[text[-1]])
    return max(sizes, default=2 << 20)


def _copies(config: LinearKernelConfig, dtype: torch.dtype) -> int:
    """Copies of the weight that overflow a core's caches ``CACHE_MULTIPLE`` times."""
    weight_bytes = max(config.input_size * config.output_size * dtype.itemsize, 1)
    wanted = math.ceil(CACHE_MULTIPLE * core_cache_bytes() / weight_bytes)
    return max(2, min(wanted, MAX_COPIES, MAX_COPY_BYTES // weight_bytes))


def _layers(config: LinearKernelConfig, dtype: torch.dtype, copies: int) -> list[_Layer]:
    generator = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(copies):
        weight = torch.randn(config.output_size, config.input_size, generator=generator)
        weight = (weight / math.sqrt(config.input_size)).to(torch.bfloat16).to(dtype)
        bias = torch.randn(config.output_size, generator=generator).to(dtype) if (
            config.has_bias) else None
        layers.append(_Layer(weight, bias))
    return layers


def _params(layer: nn.Module) -> list[tuple[str, int, tuple[int, ...], torch.dtype]]:
    return [(n, p.data_ptr(), tuple(p.shape), p.dtype) for n, p in layer.named_parameters()]


def _check(kernel: LinearKernel, layer: _Layer, x: torch.Tensor, tolerance: float) -> None:
    got = kernel.apply(layer, x, layer.bias)
    want = F.linear(x.float(), layer.weight.float(),
                    None if layer.bias is None else layer.bias.float())
    if tuple(got.shape) != tuple(want.shape) or got.dtype != x.dtype:
        raise ValueError(f"its product is {tuple(got.shape)} {got.dtype}, not "
                         f"{tuple(want.shape)} {x.dtype}")
    error = float((got.float() - want).abs().max()) / max(float(want.abs().max()), 1e-6)
    if not error <= tolerance:
        raise ValueError(f"its product differs from F.linear's by {error:.3g} of the "
                         f"largest value (at most {tolerance:g} allowed)")


def _per_call(pairs: Sequence[tuple[LinearKernel, _Layer]], x: torch.Tensor,
              calls: int) -> float:
    start = time.perf_counter()
    for i in range(calls):
        kernel, layer = pairs[i % len(pairs)]
        kernel.apply(layer, x, layer.bias)
    return (time.perf_counter() - start) / calls


def time_kernels(candidates: Sequence[type[LinearKernel]], config: LinearKernelConfig,
                 buckets: Sequence[RowBucket]) -> tuple[list[Timing], dict[str, str]]:
    """Each candidate's timings, and the reason of each one left out (by name)."""
    dtype = getattr(torch, config.act_dtype)
    copies = _copies(config, dtype)
    layers = _layers(config, dtype, copies)
    instances: dict[str, list[tuple[LinearKernel, _Layer]]] = {}
    keeps: dict[str, bool] = {}
    failed: dict[str, str] = {}
    probe = torch.randn(max(b.rows for b in buckets), config.input_size,
                        generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.inference_mode():
        for cls in candidates:
            name = cls.name or f"{cls.__module__}:{cls.__qualname__}"
            before = [_params(layer) for layer in layers]
            values = [p.detach().clone() for p in layers[0].parameters()]
            try:
                pairs = [(cls(config), layer) for layer in layers]
                for kernel, layer in pairs:
                    kernel.process_weights_after_loading(layer)
                for bucket in buckets:
                    _check(pairs[0][0], layers[0], probe[:bucket.rows],
                           TOLERANCE.get(config.act_dtype, 3e-2))
            except Exception as exc:  # noqa: BLE001 - a plugin's failure leaves it out, named
                failed[name] = describe(exc)
                layers = _layers(config, dtype, copies)  # it may have changed them
                continue
            keeps[name] = before == [_params(layer) for layer in layers] and all(
                torch.equal(a, b) for a, b in zip(values, layers[0].parameters(),
                                                  strict=True))
            instances[name] = pairs
            if not keeps[name]:  # the others get layers of their own
                layers = _layers(config, dtype, copies)
        rounds = [_time_bucket(instances, probe[:bucket.rows], bucket) for bucket in buckets]
    timings = [Timing(name, tuple(min(r[name]) for r in rounds),
                      tuple(round_spread(r[name]) for r in rounds), keeps[name])
               for name in instances]
    return timings, failed


def round_spread(times: list[float]) -> float:
    """The second-best round over the best (1.0 with one round)."""
    ordered = sorted(times)
    return ordered[1] / ordered[0] if len(ordered) > 1 and ordered[0] > 0 else 1.0


def _time_bucket(instances: dict[str, list[tuple[LinearKernel, _Layer]]], x: torch.Tensor,
                 bucket: RowBucket) -> dict[str, list[float]]:
    """Each candidate's seconds per product in each of its rounds (far slower: fewer)."""
    times: dict[str, list[float]] = {name: [] for name in instances}
    alive = list(instances)
    for _ in range(ROUNDS):
        for name in alive:
            pairs = instances[name]
            if bucket.rows > STREAMED_ROWS:
                pairs = pairs[:2]
            times[name].append(_per_call(pairs, x, len(pairs)))
        fastest = min(min(times[name]) for name in alive)
        alive = [name for name in alive if min(times[name]) <= DROP_FACTOR * fastest]
    return times
