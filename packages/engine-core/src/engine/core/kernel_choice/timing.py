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

import contextlib
import functools
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine.core.kernel_choice.buckets import RowBucket
from engine.core.kernel_choice.graph_timing import graph_replays
from engine.core.plugin_faults import describe
from engine.sdk.linear_kernel import LinearKernel, LinearKernelConfig
from engine.sdk.platform import PlatformInfo

#: Rounds each candidate is timed in (its best counts).
ROUNDS = 3
#: A candidate this many times slower than the best after a round is not timed further.
DROP_FACTOR = 3.0
#: Runs per round of a call timed by ``interleaved_rounds`` (small ones take microseconds).
MIN_CALLS = 3
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


@contextlib.contextmanager
def as_in_a_step() -> Iterator[None]:
    """Inference mode, with no ``__torch_function__`` mode in the way, as in a step.

    The worker measures while it builds the model, inside ``with torch.device(...)``: a
    torch-function mode every torch call of a kernel's Python goes through. Steps run
    without it, and it doubled the time of a kernel making a few torch calls per product
    (the ``cpu`` kernel at 1 row: 131 µs under the mode, 65 without), so the choice went
    to the wrong kernel.
    """
    with torch.inference_mode(), torch._C.DisableTorchFunction():
        yield


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
    #: The CPU step graph records it (``graph_timing``): it was timed replayed from a
    #: graph, and a kernel that is not recorded must not take a bucket from it.
    recordable: bool = False


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
    error = relative_error(got, want)
    if not error <= tolerance:
        raise ValueError(f"its product differs from F.linear's by {error:.3g} of the "
                         f"largest value (at most {tolerance:g} allowed)")


def time_kernels(candidates: Sequence[type[LinearKernel]], config: LinearKernelConfig,
                 buckets: Sequence[RowBucket], platform: PlatformInfo | None = None, *,
                 step_graph: bool = False) -> tuple[list[Timing], dict[str, str]]:
    """Each candidate's timings, and the reason of each one left out (by name).

    ``step_graph``: steps may run as a CPU step graph, so a kernel it records is timed
    replayed from one (``graph_timing``); ``platform`` is what the kernel is told.
    """
    dtype = getattr(torch, config.act_dtype)
    copies = _copies(config, dtype)
    layers = _layers(config, dtype, copies)
    instances: dict[str, list[tuple[LinearKernel, _Layer]]] = {}
    keeps: dict[str, bool] = {}
    failed: dict[str, str] = {}
    probe = torch.randn(max(b.rows for b in buckets), config.input_size,
                        generator=torch.Generator().manual_seed(1)).to(dtype)
    with as_in_a_step():
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
        recorded = {name: True for name in instances}
        rounds = []
        for bucket in buckets:
            calls, products = {}, {}
            for name, pairs in instances.items():
                each, replayed = _calls(pairs, probe[:bucket.rows], bucket, platform,
                                        step_graph)
                calls[name], products[name] = _in_turn(each), len(each)
                recorded[name] = recorded[name] and replayed
            rounds.append({name: [t / products[name] for t in times] for name, times in
                           interleaved_rounds(calls, repeats=1).items()})
    return collect_timings(rounds, list(instances), keeps, recorded), failed


def _calls(pairs: Sequence[tuple[LinearKernel, _Layer]], x: torch.Tensor, bucket: RowBucket,
           platform: PlatformInfo | None, step_graph: bool,
           ) -> tuple[list[Callable[[], object]], bool]:
    """One product per weight copy, as a step runs it; and whether from a graph."""
    if bucket.rows > STREAMED_ROWS:  # bound by compute: two weight copies suffice
        pairs = pairs[:2]
    each = graph_replays(pairs, x, platform) if step_graph else None
    if each is not None:
        return each, True
    return [functools.partial(kernel.apply, layer, x, layer.bias)
            for kernel, layer in pairs], False


def _in_turn(calls: Sequence[Callable[[], object]]) -> Callable[[], None]:
    def run() -> None:
        for call in calls:
            call()

    return run


def collect_timings(rounds: Sequence[Mapping[str, list[float]]], names: Sequence[str],
                    keeps: Mapping[str, bool] | None = None,
                    recorded: Mapping[str, bool] | None = None) -> list[Timing]:
    """A ``Timing`` per name timed in every bucket's rounds (``interleaved_rounds``).

    Its best round and spread per bucket; a name missing from a bucket (left out there)
    gets none. ``keeps`` and ``recorded``: ``keeps_layer`` and ``recordable`` by name
    (default False).
    """
    keeps, recorded = keeps or {}, recorded or {}
    return [Timing(name, tuple(min(r[name]) for r in rounds),
                   tuple(round_spread(r[name]) for r in rounds), keeps.get(name, False),
                   recorded.get(name, False))
            for name in names if all(name in r for r in rounds)]


def interleaved_rounds(calls: Mapping[str, Callable[[], object]], repeats: int = MIN_CALLS,
                       ) -> dict[str, list[float]]:
    """Each call's seconds per run in each of ``ROUNDS`` rounds, the calls in turns.

    A call this far slower than the fastest after a round (``DROP_FACTOR``) runs no more
    rounds.
    """
    times: dict[str, list[float]] = {name: [] for name in calls}
    alive = list(calls)
    for _ in range(ROUNDS):
        for name in alive:
            start = time.perf_counter()
            for _ in range(repeats):
                calls[name]()
            times[name].append((time.perf_counter() - start) / repeats)
        fastest = min(min(times[name]) for name in alive)
        alive = [name for name in alive if min(times[name]) <= DROP_FACTOR * fastest]
    return times


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference from ``want``, over ``want``'s largest magnitude."""
    return float((got.float() - want.float()).abs().max()) / max(
        float(want.float().abs().max()), 1e-6)


def round_spread(times: list[float]) -> float:
    """The second-best round over the best (1.0 with one round)."""
    ordered = sorted(times)
    return ordered[1] / ordered[0] if len(ordered) > 1 and ordered[0] > 0 else 1.0
