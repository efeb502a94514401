"""Which kernel runs each row bucket of a layer shape, decided from its timings.

The layer's *main* kernel is the one fastest in the most buckets (ties: the smaller sum
of its times relative to each bucket's best, then priority), among the kernels the CPU
step graph records where there are any: one kernel the graph cannot record keeps every
step out of the graph, and the graph's saving (the pass's Python: 20% of the benchmark
model's throughput, ``cpu`` recorded against ``onednn`` eager, where oneDNN's products
alone were up to 5% faster) is more than any one product's difference measured so far.
A kernel of yours joins the graph by declaring ``capture_support`` (docs/plugins).

Another kernel of that pool runs a bucket only where it beats the main one by more than
``SWITCH_MARGIN`` and both leave the layer's parameters as they are (two kernels share
one layer; each keeps its own copy of the weight in its layout, so a second kernel costs
memory and must earn it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.core.kernel_choice.buckets import (
    RowBucket,
    bucket_index,
    bucket_triples,
    upper_bounds,
)
from engine.core.kernel_choice.timing import Timing

#: How much faster than the main kernel another must be to run a bucket.
SWITCH_MARGIN = 0.10


@dataclass(frozen=True)
class KernelPlan:
    """The kernel of each bucket, with the timings it was chosen from."""

    buckets: tuple[RowBucket, ...]
    kernels: tuple[str, ...]
    timings: tuple[Timing, ...] = ()
    #: Candidates left out of the measuring, with the reason (it raised, wrong product).
    left_out: dict[str, str] = field(default_factory=dict)

    @property
    def names(self) -> tuple[str, ...]:
        """The distinct kernels, main first."""
        return tuple(dict.fromkeys(self.kernels))

    def kernel_for(self, rows: int) -> str:
        return self.kernels[bucket_index(upper_bounds(self.buckets), rows)]

    def describe_buckets(self) -> list[str]:
        """``["cpu for 1 row", "onednn for 2+ rows"]``: each bucket's kernel, no times."""
        return [f"{name} for {bucket.describe()}"
                for bucket, name in zip(self.buckets, self.kernels, strict=True)]

    def describe(self) -> str:
        """One clause per bucket: ``onednn for 2-4 rows (21.0 µs; cpu 30.1, torch 40.2)``."""
        clauses = []
        for index, (bucket, chosen) in enumerate(zip(self.buckets, self.kernels,
                                                     strict=True)):
            times = {t.name: t.seconds[index] * 1e6 for t in self.timings}
            others = ", ".join(f"{name} {us:.1f}" for name, us in
                               sorted(times.items(), key=lambda item: item[1])
                               if name != chosen)
            mine = f"{times[chosen]:.1f} µs" if chosen in times else "not timed"
            clauses.append(f"{chosen} for {bucket.describe()} ({mine}"
                           + (f"; {others})" if others else ")"))
        return "; ".join(clauses)

    def steady(self, limit: float) -> bool:
        """Whether each bucket's chosen kernel and its runner-up were timed steadily.

        Their second-best round within ``limit`` times their best: else the machine was
        busy and the choice may be wrong.
        """
        for index in range(len(self.buckets)):
            ranked = sorted(self.timings, key=lambda t: t.seconds[index])[:2]
            if any(t.spread[index] > limit for t in ranked):
                return False
        return True

    def to_json(self) -> dict[str, Any]:
        return {"buckets": bucket_triples(self.buckets),
                "kernels": list(self.kernels),
                "timings": [{"name": t.name, "seconds": list(t.seconds),
                             "spread": list(t.spread), "keeps_layer": t.keeps_layer,
                             "recordable": t.recordable} for t in self.timings],
                "left_out": dict(self.left_out)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> KernelPlan:
        """Raises KeyError, TypeError or ValueError on a malformed record."""
        buckets = tuple(RowBucket(int(lo), None if up is None else int(up), int(rows))
                        for lo, up, rows in data["buckets"])
        kernels = tuple(str(k) for k in data["kernels"])
        if len(kernels) != len(buckets) or not buckets:
            raise ValueError("one kernel per bucket expected")
        timings = tuple(Timing(str(t["name"]), tuple(float(s) for s in t["seconds"]),
                               tuple(float(s) for s in t["spread"]), bool(t["keeps_layer"]),
                               bool(t.get("recordable", False)))
                        for t in data["timings"])
        return cls(buckets, kernels, timings, {str(k): str(v) for k, v in
                                               data.get("left_out", {}).items()})


def choose(timings: Sequence[Timing], buckets: tuple[RowBucket, ...],
           order: Sequence[str], left_out: dict[str, str] | None = None) -> KernelPlan:
    """The plan for ``timings`` (at least one); ``order``: names by priority, for ties."""
    rank = {name: index for index, name in enumerate(order)}
    pool = [t for t in timings if t.recordable] or list(timings)

    def fastest_in(index: int, among: Sequence[Timing]) -> Timing:
        return min(among, key=lambda t: (t.seconds[index], rank.get(t.name, len(rank))))

    fastest = [fastest_in(index, pool) for index in range(len(buckets))]
    best = [f.seconds[index] for index, f in enumerate(fastest)]

    def standing(t: Timing) -> tuple[int, float, int]:
        wins = sum(f is t for f in fastest)
        relative = sum(s / b if b > 0 else 1.0 for s, b in zip(t.seconds, best, strict=True))
        return (-wins, relative, rank.get(t.name, len(rank)))

    main = min(pool, key=standing)
    sharing = [t for t in pool if t.keeps_layer] if main.keeps_layer else [main]
    kernels = []
    for index in range(len(buckets)):
        winner = fastest_in(index, sharing)
        switch = winner.seconds[index] * (1 + SWITCH_MARGIN) < main.seconds[index]
        kernels.append(winner.name if switch else main.name)
    return KernelPlan(buckets, tuple(kernels), tuple({t.name: t for t in timings}.values()),
                      dict(left_out or {}))
