"""Stat loggers under the offline ``LLM`` (in-process and spawned EngineCore), and shutdown.

The ``good`` test distribution's ``CountingStatLogger`` (``test_good_counter``) counts what
it receives and its ``shutdown()`` calls.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from engine.core import LLM
from engine.core.client.async_llm import AsyncLLM, in_process_client
from engine.core.client.stat_loggers import StatLoggerSet
from engine.core.config import EngineConfig
from engine.core.plugins import PluginEntry, _catalog
from engine.core.plugins._local import plugin_reference
from engine.sdk import IterationStats, SamplingParams, SchedulerStats, StatLogger, StatLoggerContext
from engine.sdk.groups import STAT_LOGGERS

GOOD = "engine-test-plugin-good"
FAULTY = "acme-faulty"
FAULTY_IDENTITY = "plugin 'faulty' (group engine.stat_loggers, distribution acme-faulty 0.1.0)"
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture
def counter(plugins_on_path: Path) -> Iterator[Any]:
    """``CountingStatLogger`` with its class-level counters reset."""
    from engine_test_plugin_good.stats import CountingStatLogger

    for name in ("records", "generation_tokens", "shutdowns"):
        setattr(CountingStatLogger, name, 0)
    CountingStatLogger.records_at_shutdown = -1
    yield CountingStatLogger


def _llm(checkpoint: Path, **kwargs: Any) -> LLM:
    kwargs.setdefault("in_process", True)
    return LLM(str(checkpoint), dtype="float32", num_kv_blocks=32, **kwargs)


def test_llm_feeds_stat_logger_plugins_and_shuts_them_down_once(
        tiny_llama: Path, counter: Any) -> None:
    llm = _llm(tiny_llama, plugins=GOOD)
    assert "test_good_counter" in llm.llm_engine.stat_loggers.loggers
    assert "logging" not in llm.llm_engine.stat_loggers.loggers  # log_stats is off offline
    llm.generate(["Hello", [7, 11, 13]], GREEDY, use_tqdm=False)
    assert counter.generation_tokens == 10 and counter.records > 0
    assert counter.shutdowns == 0
    llm.shutdown()
    llm.shutdown()  # idempotent: still one shutdown per logger
    assert counter.shutdowns == 1 and counter.records_at_shutdown == counter.records


def test_finished_requests_and_aborts_are_reported(tiny_llama: Path, plugins_on_path: Path,
                                                   ) -> None:
    class Recorder(StatLogger):
        finished: ClassVar[list[tuple[str, str, int]]] = []

        def record(self, scheduler_stats: SchedulerStats | None,
                   iteration_stats: IterationStats | None) -> None:
            for done in iteration_stats.finished_requests if iteration_stats else ():
                self.finished.append((done.request_id, done.finish_reason,
                                      done.num_generation_tokens))

    with _llm(tiny_llama, plugins="none") as llm:
        engine = llm.llm_engine
        engine.stat_loggers.loggers["recorder"] = Recorder(StatLoggerContext())
        engine.add_request("done", "Hello", GREEDY)
        engine.add_request("gone", "Hello", GREEDY.replace(max_tokens=50))
        while not any(o.finished for o in engine.step()):
            pass
        engine.abort_request("gone")
    assert Recorder.finished == [("done", "length", 5), ("gone", "abort", 5)]


def test_stats_come_from_a_spawned_engine_core(tiny_llama: Path, counter: Any) -> None:
    with _llm(tiny_llama, plugins=GOOD, in_process=False) as llm:
        llm.generate(["Hello"], GREEDY, use_tqdm=False)
        assert counter.generation_tokens == 5
    assert counter.shutdowns == 1


def test_log_stats_adds_the_built_in_lines(tiny_llama: Path,
                                           caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, "engine.stats"), _llm(
            tiny_llama, plugins="none", log_stats=True) as llm:
        llm.generate(["Hello"], GREEDY, use_tqdm=False)
    assert "Engine ready: model" in caplog.text
    assert "Finished request 0: prompt_tokens=5 generation_tokens=5" in caplog.text


async def test_async_llm_shuts_stat_loggers_down_once(tiny_llama: Path, counter: Any) -> None:
    config = EngineConfig(model=str(tiny_llama), dtype="float32", num_kv_blocks=32,
                          plugins=GOOD)
    llm = AsyncLLM(config, log_stats_interval=0, client=in_process_client)
    await llm.start()
    async for _ in llm.generate("a", "Hello", GREEDY):
        pass
    await llm.shutdown()
    await llm.shutdown()
    assert counter.shutdowns == 1 and counter.records_at_shutdown == counter.records
    assert counter.generation_tokens == 5


def test_a_failing_shutdown_is_logged_and_the_others_still_run(
        caplog: pytest.LogCaptureFixture) -> None:
    calls: list[str] = []

    class Broken(StatLogger):
        def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
            pass

        def shutdown(self) -> None:
            calls.append("broken")
            raise OSError("disk full")

    class Fine(Broken):
        def shutdown(self) -> None:
            calls.append("fine")

    loggers = StatLoggerSet([("broken", Broken(StatLoggerContext())),
                             ("fine", Fine(StatLoggerContext()))])
    with caplog.at_level(logging.ERROR, "engine.stats"):
        loggers.shutdown()
        loggers.shutdown()
    assert calls == ["broken", "fine"]
    assert "stat logger 'broken': shutdown() raised OSError: disk full" in caplog.text
    assert loggers.failures == {"broken": 1}


# -- run-time faults: a stat logger that raises (docs/plugins/stat-loggers.md) -------------


class FaultyStatLogger(StatLogger):
    """Raises ``error`` from ``record()`` while it is set; ``shutdown()`` always raises."""

    error: ClassVar[Exception | None] = None
    calls: ClassVar[int] = 0
    ok: ClassVar[int] = 0

    def record(self, scheduler_stats: SchedulerStats | None,
               iteration_stats: IterationStats | None) -> None:
        FaultyStatLogger.calls += 1
        if FaultyStatLogger.error is not None:
            raise FaultyStatLogger.error
        FaultyStatLogger.ok += 1

    def shutdown(self) -> None:
        raise OSError("flush failed")


@pytest.fixture
def faulty(counter: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[type[FaultyStatLogger]]:
    """``FaultyStatLogger`` installed as plugin ``faulty`` of distribution ``acme-faulty``."""
    entry = PluginEntry(STAT_LOGGERS, "faulty", plugin_reference(FaultyStatLogger), FAULTY,
                        "0.1.0")
    discover = _catalog.discover_entries
    monkeypatch.setattr(_catalog, "discover_entries", lambda: [*discover(), entry])
    FaultyStatLogger.error = RuntimeError("exporter down")
    FaultyStatLogger.calls = FaultyStatLogger.ok = 0
    yield FaultyStatLogger
    FaultyStatLogger.error = None


def _messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "engine.stats" and r.levelno == level]


def test_a_raising_stat_logger_under_llm_fails_no_request(
        tiny_llama: Path, counter: Any, faulty: type[FaultyStatLogger],
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, "engine.stats"), _llm(
            tiny_llama, plugins=f"{GOOD},{FAULTY}") as llm:
        outputs = llm.generate(["Hello", [7, 11, 13]], GREEDY, use_tqdm=False)
        assert [(o.finished, len(o.outputs[0].token_ids)) for o in outputs] == [(True, 5)] * 2
        loggers = llm.llm_engine.stat_loggers
        assert faulty.calls > 1 and loggers.failures["faulty"] == faulty.calls
        assert counter.records == faulty.calls and counter.generation_tokens == 10
        [error] = [r for r in caplog.records if r.levelno == logging.ERROR]  # once, not per step
        assert error.getMessage().startswith(
            f"{FAULTY_IDENTITY}: record() raised RuntimeError: exporter down. Its stats of "
            "this call are lost; requests and the other stat loggers are unaffected.")
        assert error.exc_info is not None  # with the traceback
        faulty.error = ValueError("bad label")  # another error: logged again, once
        llm.generate(["Hello"], GREEDY, use_tqdm=False)
        faulty.error = None  # healed: still called, so its records arrive again
        assert len(llm.generate(["Hello"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 5
        assert faulty.ok > 0 and counter.records == faulty.calls
    errors = _messages(caplog, logging.ERROR)
    assert [m.partition(". ")[0] for m in errors] == [
        f"{FAULTY_IDENTITY}: record() raised RuntimeError: exporter down",
        f"{FAULTY_IDENTITY}: record() raised ValueError: bad label",
        f"{FAULTY_IDENTITY}: shutdown() raised OSError: flush failed"]
    [summary] = _messages(caplog, logging.WARNING)
    failed = faulty.calls - faulty.ok
    assert summary == (f"{FAULTY_IDENTITY}: {failed + 1} failed calls while the engine ran "
                       f"(record() {failed}, shutdown() 1)")
    assert counter.shutdowns == 1  # the other logger's shutdown() still ran


async def test_a_raising_stat_logger_under_async_llm_fails_no_request(
        tiny_llama: Path, counter: Any, faulty: type[FaultyStatLogger],
        caplog: pytest.LogCaptureFixture) -> None:
    config = EngineConfig(model=str(tiny_llama), dtype="float32", num_kv_blocks=32,
                          plugins=f"{GOOD},{FAULTY}")
    llm = AsyncLLM(config, log_stats_interval=0, client=in_process_client)
    with caplog.at_level(logging.INFO, "engine.stats"):
        await llm.start()
        try:
            for request_id in ("a", "b"):
                outputs = [o async for o in llm.generate(request_id, "Hello", GREEDY)]
                assert outputs[-1].finished
                assert len(outputs[-1].outputs[0].token_ids) == 5
            assert llm.dead_error is None  # the engine is still serving
            assert llm.stat_loggers.failures["faulty"] == faulty.calls > 1
            assert counter.records == faulty.calls and counter.generation_tokens == 10
        finally:
            await llm.shutdown()
    errors = _messages(caplog, logging.ERROR)
    assert [m.partition(". ")[0] for m in errors] == [
        f"{FAULTY_IDENTITY}: record() raised RuntimeError: exporter down",
        f"{FAULTY_IDENTITY}: shutdown() raised OSError: flush failed"]
    assert counter.shutdowns == 1
