"""The model's CPU threads follow the CPUs other processes leave free, measured as it runs.

A step's parallel regions wait for their slowest thread. On a quiet machine the model's
threads spin briefly between regions (``GOMP_SPINCOUNT``, see :mod:`engine.core.cpu_threads`)
and a step runs at full speed. When another process keeps one of the CPUs busy, a thread
sharing that CPU gets a fraction of it and every region waits for it: with two threads on a
2-core machine the engine kept 38% of its quiet throughput, where one thread on the CPU the
neighbour left kept 63% (benchmarks/README.md, issue 35).

So the worker measures, every :data:`WINDOW_S` seconds of steps, how much of the CPUs it may
use went to other processes (``/proc/stat``'s busy time on those CPUs, less this process's
own CPU time from :func:`os.times`), and runs the next steps on the CPUs left: at most the
threads it started with, at least one, one fewer per CPU the others take
(:func:`wanted_threads`). A change needs :data:`CONFIRM` windows in a row agreeing, so one
busy moment does not flap the count; each change is logged at INFO with the measurement.

Only a worker that chose its own thread count does this: ``--num-threads`` fixes it.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from engine.core.cpu_threads import this_process

logger = logging.getLogger("engine.threads")

#: Per-CPU time counters of the whole machine.
PROC_STAT = Path("/proc/stat")
#: Seconds of steps between two measurements: long enough for ``/proc/stat``'s clock ticks
#: (100 a second) to resolve a few percent of a CPU, short enough to follow a neighbour
#: that comes and goes within seconds.
WINDOW_S = 0.5
#: Measurements in a row that must want the same new count before it changes.
CONFIRM = 2
#: Share of a CPU the others may take before the model gives that CPU up. Below it the
#: model's threads still win: a 2-thread step with the front end's detokenizing beside it
#: beats a 1-thread one (measured: 1350 vs 900 tok/s on the benchmark model).
KEEP_BELOW = 0.6


def busy_cpu_seconds(cpus: Collection[int], stat: Path | None = None) -> float | None:
    """Seconds ``cpus`` spent not idle since boot, from ``stat`` (default :data:`PROC_STAT`).

    Steal counts as busy: the hypervisor's other guests took it. None where the file cannot
    be read (not Linux).
    """
    stat = PROC_STAT if stat is None else stat
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    wanted = {f"cpu{cpu}" for cpu in cpus}
    ticks = 0
    for line in lines:
        fields = line.split()
        if fields and fields[0] in wanted:
            # user nice system idle iowait irq softirq steal [guest guest_nice]: guest time is
            # counted in user already
            counters = [int(v) for v in fields[1:9]]
            ticks += sum(counters) - counters[3] - counters[4]
    return ticks / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU seconds this process's threads have run (user + system)."""
    times = os.times()
    return times.user + times.system


def wanted_threads(others: float, capacity: float, max_threads: int) -> int:
    """Threads for the model when other processes keep ``others`` CPUs busy.

    ``capacity``: the CPUs this process may use (its affinity, or its cgroup quota where
    smaller). A CPU is given up once the others take :data:`KEEP_BELOW` of it.
    """
    free = capacity - others
    return max(1, min(max_threads, math.ceil(free + KEEP_BELOW - 1)))


@dataclass(frozen=True)
class Measurement:
    """One window: its length and the CPUs the others kept busy in it."""

    seconds: float
    others: float


class ThreadGovernor:
    """Sets the model's thread count from the CPUs other processes leave free.

    Call :meth:`before_step` before each step; it measures every ``window_s`` seconds and
    calls ``set_threads`` when the count changes.

    Args:
        max_threads: The count the worker chose at start; never exceeded.
        cpus: The CPUs this process may run on (its affinity).
        capacity: The CPUs it may use (``len(cpus)``, or its cgroup quota where smaller).
        set_threads: Applies a count (``torch.set_num_threads``).
    """

    def __init__(self, max_threads: int, cpus: Collection[int], capacity: float,
                 set_threads: Callable[[int], None], *, window_s: float = WINDOW_S,
                 clock: Callable[[], float] = time.monotonic,
                 read_busy: Callable[[Collection[int]], float | None] = busy_cpu_seconds,
                 read_own: Callable[[], float] = own_cpu_seconds) -> None:
        self.max_threads = max_threads
        self.threads = max_threads
        self._cpus = tuple(cpus)
        self._capacity = capacity
        self._set_threads = set_threads
        self._window_s = window_s
        self._clock = clock
        self._read_busy = read_busy
        self._read_own = read_own
        self._pending: int | None = None
        self._agreeing = 0
        self._start = self._sample()

    def _sample(self) -> tuple[float, float, float] | None:
        busy = self._read_busy(self._cpus)
        return None if busy is None else (self._clock(), busy, self._read_own())

    def before_step(self) -> None:
        """Measure if a window has passed; change the thread count if it is confirmed."""
        if self._start is None or self._clock() - self._start[0] < self._window_s:
            return
        end = self._sample()
        if end is None:
            self._start = None  # /proc/stat went away: keep the count
            return
        measurement = Measurement(
            seconds=end[0] - self._start[0],
            others=max(0.0, (end[1] - self._start[1] - (end[2] - self._start[2]))
                       / (end[0] - self._start[0])))
        self._start = end
        self._decide(measurement)

    def _decide(self, measurement: Measurement) -> None:
        wanted = wanted_threads(measurement.others, self._capacity, self.max_threads)
        if wanted == self.threads:
            self._pending, self._agreeing = None, 0
            return
        if wanted != self._pending:
            self._pending, self._agreeing = wanted, 0
        self._agreeing += 1
        if self._agreeing < CONFIRM:
            return
        logger.info("model threads %d -> %d: other processes kept %.2f of %g CPU(s) busy "
                    "over the last %.1f s", self.threads, wanted, measurement.others,
                    self._capacity, measurement.seconds)
        self.threads = wanted
        self._pending, self._agreeing = None, 0
        self._set_threads(wanted)


def follow_free_cpus(max_threads: int) -> ThreadGovernor | None:
    """A governor of ``torch``'s thread count for this process, or None.

    None where there is nothing to govern (one thread) or nothing to measure (no
    ``/proc/stat``).
    """
    import torch

    allowance = this_process()
    cpus = (os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity")
            else range(os.cpu_count() or 1))
    if max_threads < 2 or busy_cpu_seconds(cpus) is None:
        return None
    capacity = float(allowance.affinity if allowance.quota is None
                     else min(allowance.affinity, allowance.quota))
    return ThreadGovernor(max_threads, cpus, capacity, torch.set_num_threads,
                          window_s=WINDOW_S, read_busy=busy_cpu_seconds)


__all__ = ["CONFIRM", "KEEP_BELOW", "PROC_STAT", "WINDOW_S", "Measurement", "ThreadGovernor",
           "busy_cpu_seconds", "follow_free_cpus", "own_cpu_seconds", "wanted_threads"]
