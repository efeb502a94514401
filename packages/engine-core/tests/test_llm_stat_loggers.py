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
from engine.sdk import IterationStats, SamplingParams, SchedulerStats, StatLogger, StatLoggerContext

GOOD = "engine-test-plugin-good"
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
    assert "stat logger 'broken' raised in shutdown()" in caplog.text
