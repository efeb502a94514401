"""The model's threads follow the CPUs other processes leave free (engine.core.thread_governor).

Unit level: ``/proc/stat`` is read as the kernel writes it, the count wanted for each share
the others take, and the governor's windows (a change needs two agreeing measurements,
never above the start count, logged). End to end (tiny Llama, EngineCore in process): with
every CPU reported busy the worker drops to one thread, its step graph replays on one
thread, and the tokens are those of two threads; ``--num-threads`` fixes the count.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.core import LLM, SamplingParams
from engine.core import thread_governor as governor_module
from engine.core.cpu_threads import this_process
from engine.core.native.graph import KernelGraph
from engine.core.thread_governor import (
    CONFIRM,
    ThreadGovernor,
    busy_cpu_seconds,
    follow_free_cpus,
    wanted_threads,
)
from engine.kernels.cpu.native import native_kernels

STAT = """cpu  900 0 300 5000 100 0 0 50 0 0
cpu0 500 0 100 2000 60 0 0 30 0 0
cpu1 400 0 200 3000 40 0 0 20 0 0
intr 12345 0 0
ctxt 999
"""


def test_busy_time_counts_what_is_not_idle_on_the_given_cpus(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text(STAT)
    hz = os.sysconf("SC_CLK_TCK")
    # user + nice + system + irq + softirq + steal; idle and iowait are not busy
    assert busy_cpu_seconds([0], stat) == pytest.approx(630 / hz)
    assert busy_cpu_seconds([0, 1], stat) == pytest.approx(1250 / hz)
    assert busy_cpu_seconds([], stat) == 0
    assert busy_cpu_seconds([0], tmp_path / "absent") is None


@pytest.mark.parametrize(("others", "capacity", "max_threads", "wanted"), [
    (0.0, 2, 2, 2),
    (0.5, 2, 2, 2),   # the front end's detokenizing beside a quiet step: keep both
    (0.65, 2, 2, 1),  # most of a CPU gone
    (1.0, 2, 2, 1),
    (2.0, 2, 2, 1),   # never fewer than one
    (0.0, 8, 4, 4),   # never more than the start count
    (5.0, 8, 8, 3),
    (0.7, 1.5, 2, 1),  # a cgroup quota of 1.5 CPUs
])
def test_wanted_threads(others: float, capacity: float, max_threads: int,
                        wanted: int) -> None:
    assert wanted_threads(others, capacity, max_threads) == wanted


class Machine:
    """A clock, the busy time of two CPUs and this process's CPU time, advanced by hand."""

    def __init__(self) -> None:
        self.now = self.busy = self.own = 0.0
        self.threads: list[int] = []

    def window(self, seconds: float, own: float, others: float) -> None:
        """``seconds`` pass with this process using ``own`` CPUs and others ``others``."""
        self.now += seconds
        self.own += own * seconds
        self.busy += (own + others) * seconds

    def governor(self) -> ThreadGovernor:
        return ThreadGovernor(2, [0, 1], 2.0, self.threads.append, window_s=0.5,
                              clock=lambda: self.now, read_busy=lambda cpus: self.busy,
                              read_own=lambda: self.own)


def test_a_busy_neighbour_takes_a_thread_and_gives_it_back(
        caplog: pytest.LogCaptureFixture) -> None:
    machine = Machine()
    governor = machine.governor()
    machine.window(0.2, own=2, others=1)
    governor.before_step()  # not a window yet
    machine.window(0.4, own=2, others=1)
    governor.before_step()  # one busy window: not confirmed
    assert machine.threads == [] and governor.threads == 2
    machine.window(0.6, own=2, others=0.1)
    governor.before_step()  # quiet again: the pending change is forgotten
    for _ in range(CONFIRM - 1):
        machine.window(0.6, own=2, others=0.9)
        governor.before_step()
    assert machine.threads == []
    caplog.set_level(logging.INFO, "engine.threads")
    machine.window(0.6, own=1, others=0.9)
    governor.before_step()
    assert machine.threads == [1] and governor.threads == 1
    assert caplog.messages == ["model threads 2 -> 1: other processes kept 0.90 of 2 CPU(s) "
                               "busy over the last 0.6 s"]
    for _ in range(CONFIRM):
        machine.window(0.6, own=1, others=1.0)
        governor.before_step()
    assert machine.threads == [1]
    for _ in range(CONFIRM):
        machine.window(0.6, own=1, others=0.05)
        governor.before_step()
    assert machine.threads == [1, 2] and governor.threads == 2


def test_no_proc_stat_means_nothing_is_governed(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    monkeypatch.setattr(governor_module, "PROC_STAT", tmp_path / "absent")
    assert follow_free_cpus(2) is None
    monkeypatch.undo()
    assert follow_free_cpus(1) is None  # one thread: nothing to give up


NATIVE = native_kernels()
needs_graph = pytest.mark.skipif(
    NATIVE is None or torch.float32 not in NATIVE.packed_matmul_dtypes
    or this_process().num_cpus < 2,
    reason="needs 2 CPUs and the float32 step graph (AVX-512)")
PROMPTS = [[5 + i for i in range(n)] for n in (3, 40, 17, 1)]
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)


def generate(path: Path, **options: Any) -> list[Any]:
    with LLM(str(path), dtype="float32", plugins="none", num_kv_blocks=64, in_process=True,
             max_num_batched_tokens=64, **options) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS,
                               use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


@pytest.fixture
def restore_threads() -> Any:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@needs_graph
@pytest.mark.usefixtures("restore_threads")
def test_every_cpu_busy_narrows_the_worker_to_one_thread_with_the_same_tokens(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fixed = generate(tiny_llama, num_threads=2)
    replays: list[int] = []
    original = KernelGraph.run

    def counted(self: KernelGraph, *args: Any, **kwargs: Any) -> torch.Tensor:
        replays.append(torch.get_num_threads())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(KernelGraph, "run", counted)
    monkeypatch.setattr(governor_module, "WINDOW_S", 0.0)  # measure before every step
    # every CPU busy all the time, this process's own time included in it
    monkeypatch.setattr(governor_module, "busy_cpu_seconds",
                        lambda cpus: len(cpus) * time.monotonic())
    assert generate(tiny_llama) == fixed
    assert replays[0] == 2 and replays[-1] == 1 and replays.count(1) >= 10

    replays.clear()
    assert generate(tiny_llama, num_threads=2) == fixed  # --num-threads: not governed
    assert set(replays) == {2}
