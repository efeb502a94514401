"""How many CPU threads the engine's processes use, decided in one place.

The CPUs a process may use are its affinity (``os.sched_getaffinity``: ``taskset``,
``numactl``, a container's cpuset) capped by its cgroup's CPU quota (cgroup v2
``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, the tightest along the
process's cgroup path; ``docker run --cpus 1.5`` gives 2 threads, rounded up as the JVM and
Go runtimes do). Every count below starts from that:

* the model's threads (``torch.set_num_threads`` in each worker): the CPUs divided among
  the tensor-parallel ranks, at least 1, unless ``--num-threads`` says otherwise;
* the front end's tokenizer threads: at least 2, at most 8, else one per CPU;
* the CPUs a local Ray instance declares, and the ranks the CPU platform can host.

:func:`model_threads` logs its decision once per process with the reason.

Threads that wait give their CPU back soon. torch's CPU build runs its parallel regions on
GNU OpenMP (``libgomp``, shared by oneDNN, MKL and the engine's C++ kernels), whose idle
threads spin between regions by default (``GOMP_SPINCOUNT``: 300 000 rounds of ``pause``,
3-7 ms measured on a Sapphire Rapids): a model thread holds its core long after a step,
while the step's Python or another process could use it. Sleeping at once
(``OMP_WAIT_POLICY=PASSIVE``) costs more: every region then wakes its threads (a futex and,
in a VM, an interrupt between CPUs), ~0.1 ms each on that machine, a quarter of the quiet
throughput at batch 64 (benchmarks/README.md, issue 35). So the processes the engine
starts (EngineCore, its workers, a local Ray instance) get ``GOMP_SPINCOUNT=10000`` in
their environment (:func:`yielding_waits`): a spin of ~0.1-0.2 ms spans the Python between
two regions of a step (1000 did not: as slow as sleeping) and ends soon after the step.
The OpenMP runtime reads it once, when it loads with torch; an operator who set
``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT`` or ``KMP_BLOCKTIME`` (Intel's runtime) keeps their
choice. A process that has loaded torch already (the caller's, under
``LLM(in_process=True)``) keeps the policy it started with. How many threads run each step
follows the CPUs other processes leave free: :mod:`engine.core.thread_governor`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("engine.threads")

#: Where the cgroup file systems are mounted.
CGROUP_ROOT = Path("/sys/fs/cgroup")
#: This process's cgroup membership, one ``ID:CONTROLLERS:PATH`` line per hierarchy.
PROC_CGROUP = Path("/proc/self/cgroup")
#: Tokenizer threads of the front end: at least this many (one long prompt must not hold
#: up the others) and at most ...
MIN_TOKENIZER_THREADS = 2
#: ... this many (the work is CPU-bound; more threads than CPUs only queue).
MAX_TOKENIZER_THREADS = 8
#: The OpenMP runtimes' settings of how an idle thread waits; an operator who set any of
#: them has chosen, and the engine adds nothing.
WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
#: What the engine's processes get where the operator chose nothing: idle threads spin
#: ~0.1-0.2 ms, then sleep.
YIELDING_WAITS = {"GOMP_SPINCOUNT": "10000"}


@dataclass(frozen=True)
class CpuAllowance:
    """The CPUs this process may use, and why that many.

    Attributes:
        num_cpus: Whole CPUs: the affinity, capped by the quota rounded up; at least 1.
        affinity: CPUs in this process's affinity mask.
        quota: CPUs the cgroup quota allows (may be fractional); None: no quota.
    """

    num_cpus: int
    affinity: int
    quota: float | None = None

    @property
    def reason(self) -> str:
        """How ``num_cpus`` was reached, for a log line."""
        why = f"{self.affinity} CPU(s) in this process's affinity"
        if self.quota is not None:
            capped = "caps it" if self.quota < self.affinity else "does not cap it"
            why += f", a cgroup CPU quota of {self.quota:g} CPU(s) {capped}"
        return why


def _cgroup_paths(cgroup_file: Path) -> dict[str, str]:
    """Controller (``""`` for cgroup v2's unified hierarchy) -> this process's cgroup path."""
    try:
        lines = cgroup_file.read_text().splitlines()
    except OSError:
        return {}
    paths: dict[str, str] = {}
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                paths.setdefault(controller, parts[2])
    return paths


def _levels(base: Path, path: str) -> list[Path]:
    """``base/path`` and each ancestor up to ``base`` (``base`` alone if the path is absent).

    In a container without a cgroup namespace ``/proc/self/cgroup`` names the host's path
    while ``base`` is already the container's own cgroup: then ``base`` is all there is.
    """
    leaf = base / path.strip("/")
    if not leaf.is_dir():
        return [base]
    levels = [leaf]
    while levels[-1] != base and base in levels[-1].parents:
        levels.append(levels[-1].parent)
    return levels


def _read_v2(directory: Path) -> float | None:
    """CPUs ``directory/cpu.max`` allows (``"max 100000"``: None)."""
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _read_v1(directory: Path) -> float | None:
    """CPUs ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` in ``directory`` allow (-1: None)."""
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, cgroup_file: Path = PROC_CGROUP,
                     ) -> float | None:
    """CPUs this process's cgroup quota allows (the tightest level), or None without one.

    Args:
        root: Where the cgroup file systems are mounted: cgroup v2's unified hierarchy at
            ``root`` itself, v1's ``cpu`` controller at ``root/cpu`` (or ``cpu,cpuacct``).
        cgroup_file: ``/proc/self/cgroup`` or a stand-in.
    """
    paths = _cgroup_paths(cgroup_file)
    quotas: list[float] = []
    if "" in paths and (root / "cgroup.controllers").exists():
        quotas += [q for d in _levels(root, paths[""]) if (q := _read_v2(d)) is not None]
    if "cpu" in paths:
        for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
            if (root / name).is_dir():
                quotas += [q for d in _levels(root / name, paths["cpu"])
                           if (q := _read_v1(d)) is not None]
                break
    return min(quotas) if quotas else None


def cpu_allowance(root: Path = CGROUP_ROOT, cgroup_file: Path = PROC_CGROUP,
                  affinity: int | None = None) -> CpuAllowance:
    """The CPUs this process may use: its affinity capped by its cgroup CPU quota.

    Args:
        root: The cgroup mount point (see :func:`cgroup_cpu_quota`).
        cgroup_file: ``/proc/self/cgroup`` or a stand-in.
        affinity: CPUs in the affinity mask; default: ``os.sched_getaffinity(0)``
            (``os.cpu_count()`` where the platform has no affinity).
    """
    if affinity is None:
        affinity = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                    else os.cpu_count() or 1)
    quota = cgroup_cpu_quota(root, cgroup_file)
    num_cpus = affinity if quota is None else min(affinity, math.ceil(quota))
    return CpuAllowance(num_cpus=max(1, num_cpus), affinity=affinity, quota=quota)


@functools.cache
def this_process() -> CpuAllowance:
    """:func:`cpu_allowance` of this process, read once."""
    return cpu_allowance()


@dataclass(frozen=True)
class ThreadChoice:
    """How many threads, and why (for the log line)."""

    num_threads: int
    reason: str


def model_threads(configured: int | None, world_size: int = 1,
                  allowance: CpuAllowance | None = None) -> ThreadChoice:
    """The model's CPU threads in one worker: ``configured`` if given, else a fair share.

    Args:
        configured: ``--num-threads`` (``EngineConfig.num_threads``); None: decide here.
        world_size: Tensor-parallel ranks sharing the CPUs (one process each).
        allowance: The CPUs to share; default: this process's (:func:`this_process`).
    """
    if configured is not None:
        return ThreadChoice(configured, "--num-threads")
    allowance = allowance or this_process()
    threads = max(1, allowance.num_cpus // max(1, world_size))
    reason = allowance.reason
    if world_size > 1:
        reason += f", shared by {world_size} tensor-parallel ranks"
    return ThreadChoice(threads, reason)


def tokenizer_threads(allowance: CpuAllowance | None = None) -> int:
    """Threads of the front end's tokenizer pool: one per CPU, within [2, 8]."""
    cpus = (allowance or this_process()).num_cpus
    return max(MIN_TOKENIZER_THREADS, min(MAX_TOKENIZER_THREADS, cpus))


@functools.cache
def log_choice(what: str, choice: ThreadChoice) -> None:
    """Log ``choice`` once per process (INFO)."""
    logger.info("%s: %d thread(s) (%s)", what, choice.num_threads, choice.reason)


def wait_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables a process the engine starts needs added so its idle threads yield.

    Empty when ``environ`` (default: this process's) already sets one of
    :data:`WAIT_SETTINGS`: the operator's choice wins.
    """
    environ = os.environ if environ is None else environ
    if any(name in environ for name in WAIT_SETTINGS):
        return {}
    return dict(YIELDING_WAITS)


@contextlib.contextmanager
def yielding_waits() -> Iterator[None]:
    """Processes started inside inherit :func:`wait_environment`; restored after."""
    added = wait_environment()
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


__all__ = [
    "CGROUP_ROOT",
    "WAIT_SETTINGS",
    "YIELDING_WAITS",
    "CpuAllowance",
    "ThreadChoice",
    "cgroup_cpu_quota",
    "cpu_allowance",
    "log_choice",
    "model_threads",
    "this_process",
    "tokenizer_threads",
    "wait_environment",
    "yielding_waits",
]
