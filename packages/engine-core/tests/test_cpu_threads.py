"""``engine.core.cpu_threads``: the CPUs a process may use, the threads it runs, how they wait.

The cgroup cases read a fake cgroup file system built in ``tmp_path``; the process cases
start a real EngineCore (and ``mp`` worker) and read the environment it started with.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from engine.core import LLM
from engine.core.cpu_threads import (
    WAIT_SETTINGS,
    CpuAllowance,
    cgroup_cpu_quota,
    cpu_allowance,
    log_choice,
    model_threads,
    tokenizer_threads,
    wait_environment,
    yielding_waits,
)
from engine.core.frontend.tokenizer_pool import TokenizerPool

OPTIONS: dict[str, Any] = {"dtype": "float32", "num_kv_blocks": 64, "plugins": "none"}


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def v2_root(tmp_path: Path, levels: dict[str, str], member: str) -> tuple[Path, Path]:
    """A cgroup v2 mount with ``cpu.max`` per level, and a /proc/self/cgroup naming ``member``."""
    root = tmp_path / "cgroup"
    write(root / "cgroup.controllers", "cpuset cpu io memory pids\n")
    for level, cpu_max in levels.items():
        write(root / level.strip("/") / "cpu.max", cpu_max + "\n")
    (root / member.strip("/")).mkdir(parents=True, exist_ok=True)
    membership = tmp_path / "proc-self-cgroup"
    write(membership, f"0::{member}\n")
    return root, membership


def v1_root(tmp_path: Path, controller: str, levels: dict[str, tuple[int, int]],
            member: str) -> tuple[Path, Path]:
    """A cgroup v1 ``cpu`` hierarchy at ``root/controller`` with a quota per level."""
    root = tmp_path / "cgroup"
    for level, (quota, period) in levels.items():
        directory = root / controller / level.strip("/")
        write(directory / "cpu.cfs_quota_us", f"{quota}\n")
        write(directory / "cpu.cfs_period_us", f"{period}\n")
    membership = tmp_path / "proc-self-cgroup"
    write(membership, f"12:memory:/elsewhere\n4:{controller}:{member}\n1:name=systemd:/x\n")
    return root, membership


def test_without_a_cgroup_quota_the_affinity_decides(tmp_path: Path) -> None:
    allowance = cpu_allowance(tmp_path / "none", tmp_path / "no-file", affinity=6)
    assert allowance == CpuAllowance(num_cpus=6, affinity=6, quota=None)
    assert allowance.reason == "6 CPU(s) in this process's affinity"


def test_the_affinity_default_is_this_processs() -> None:
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no affinity on this platform")
    assert cpu_allowance().affinity == len(os.sched_getaffinity(0))


@pytest.mark.parametrize(("levels", "quota", "num_cpus"), [
    ({"/": "max 100000", "/job.slice/run": "150000 100000"}, 1.5, 2),  # rounded up
    ({"/job.slice": "100000 100000", "/job.slice/run": "300000 100000"}, 1.0, 1),  # tighter parent
    ({"/job.slice/run": "max 100000"}, None, 4),
    ({"/job.slice/run": "50000 100000"}, 0.5, 1),  # never below one
])
def test_a_cgroup_v2_quota_caps_the_affinity(tmp_path: Path, levels: dict[str, str],
                                             quota: float | None, num_cpus: int) -> None:
    root, membership = v2_root(tmp_path, levels, "/job.slice/run")
    assert cgroup_cpu_quota(root, membership) == quota
    allowance = cpu_allowance(root, membership, affinity=4)
    assert (allowance.quota, allowance.num_cpus) == (quota, num_cpus)
    if quota is not None:
        assert f"a cgroup CPU quota of {quota:g} CPU(s) caps it" in allowance.reason


@pytest.mark.parametrize("controller", ["cpu", "cpu,cpuacct"])
def test_a_cgroup_v1_quota_caps_the_affinity(tmp_path: Path, controller: str) -> None:
    root, membership = v1_root(tmp_path, controller,
                               {"/": (-1, 100000), "/docker/abc": (250000, 100000)},
                               "/docker/abc")
    assert cgroup_cpu_quota(root, membership) == 2.5
    assert cpu_allowance(root, membership, affinity=8).num_cpus == 3
    # a quota above the affinity does not raise it
    assert cpu_allowance(root, membership, affinity=2).num_cpus == 2


def test_a_v1_container_without_a_cgroup_namespace_reads_its_own_mount(tmp_path: Path) -> None:
    # /proc/self/cgroup names the host's path; the mount is the container's cgroup itself
    root, membership = v1_root(tmp_path, "cpu,cpuacct", {"/": (100000, 100000)},
                               "/docker/0123abcd")
    assert cgroup_cpu_quota(root, membership) == 1.0
    assert cgroup_cpu_quota(root, tmp_path / "no-such-file") is None


def test_an_explicit_thread_count_wins() -> None:
    allowance = CpuAllowance(num_cpus=2, affinity=8, quota=2.0)
    choice = model_threads(6, world_size=2, allowance=allowance)
    assert (choice.num_threads, choice.reason) == (6, "--num-threads")


@pytest.mark.parametrize(("cpus", "world_size", "threads"), [(8, 1, 8), (8, 2, 4), (3, 2, 1),
                                                              (1, 2, 1)])
def test_tensor_parallel_ranks_share_the_cpus(cpus: int, world_size: int, threads: int) -> None:
    choice = model_threads(None, world_size, CpuAllowance(num_cpus=cpus, affinity=cpus))
    assert choice.num_threads == threads
    assert ("shared by 2 tensor-parallel ranks" in choice.reason) == (world_size == 2)


def test_the_decision_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    choice = model_threads(None, 1, CpuAllowance(num_cpus=3, affinity=4, quota=2.2))
    with caplog.at_level(logging.INFO, logger="engine.threads"):
        log_choice("test model", choice)
        log_choice("test model", choice)
    assert [r.getMessage() for r in caplog.records] == [
        "test model: 3 thread(s) (4 CPU(s) in this process's affinity, a cgroup CPU quota of "
        "2.2 CPU(s) caps it)"]


@pytest.mark.parametrize(("cpus", "threads"), [(1, 2), (4, 4), (64, 8)])
def test_tokenizer_threads_follow_the_cpus(cpus: int, threads: int,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    allowance = CpuAllowance(num_cpus=cpus, affinity=cpus)
    assert tokenizer_threads(allowance) == threads
    monkeypatch.setattr("engine.core.frontend.tokenizer_pool.tokenizer_threads",
                        lambda: tokenizer_threads(allowance))
    assert TokenizerPool().num_threads == threads


@pytest.mark.parametrize("name", WAIT_SETTINGS)
def test_the_operators_wait_setting_wins(name: str) -> None:
    assert wait_environment({name: "1"}) == {}
    assert wait_environment({"OMP_NUM_THREADS": "2"}) == {"GOMP_SPINCOUNT": "10000"}


def clear_wait_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in WAIT_SETTINGS:
        monkeypatch.delenv(name, raising=False)


def test_yielding_waits_restores_this_processs_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clear_wait_settings(monkeypatch)
    with yielding_waits():
        assert os.environ["GOMP_SPINCOUNT"] == "10000"
    assert "GOMP_SPINCOUNT" not in os.environ
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    with yielding_waits():
        assert os.environ["OMP_WAIT_POLICY"] == "active"
    assert os.environ["OMP_WAIT_POLICY"] == "active"


def started_with(pid: int) -> dict[str, str]:
    """The environment process ``pid`` started with."""
    with open(f"/proc/{pid}/environ", "rb") as environ:
        entries = environ.read().split(b"\0")
    return dict(e.decode().split("=", 1) for e in entries if b"=" in e)


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc/PID/environ")


@linux_only
@pytest.mark.parametrize(("operator", "wanted"), [
    ({}, {"GOMP_SPINCOUNT": "10000"}),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_WAIT_POLICY": "ACTIVE"}),
    ({"GOMP_SPINCOUNT": "300000"}, {"GOMP_SPINCOUNT": "300000"}),
])
def test_the_engine_core_process_starts_with_yielding_waits(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, operator: dict[str, str],
        wanted: dict[str, str]) -> None:
    clear_wait_settings(monkeypatch)
    for name, value in operator.items():
        monkeypatch.setenv(name, value)
    with LLM(str(tiny_llama), **OPTIONS) as llm:
        pid = llm.llm_engine.core.client.pid  # type: ignore[union-attr]
        environ = started_with(pid)
    assert {n: environ[n] for n in WAIT_SETTINGS if n in environ} == wanted
    assert {n: os.environ[n] for n in WAIT_SETTINGS if n in os.environ} == operator


@linux_only
def test_worker_processes_start_with_yielding_waits(tiny_llama: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    clear_wait_settings(monkeypatch)
    with LLM(str(tiny_llama), in_process=True, distributed_executor_backend="mp",
             **OPTIONS) as llm:
        (process,) = llm.llm_engine.core.executor.processes
        assert started_with(process.pid)["GOMP_SPINCOUNT"] == "10000"
    assert "GOMP_SPINCOUNT" not in os.environ
