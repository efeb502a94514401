"""``AsyncLLM`` over ``InProcessCoreClient``: outputs, aborts, death, stats, idling."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from engine.core import LLM
from engine.core.client.async_llm import AsyncLLM, in_process_client
from engine.core.client.in_process import InProcessCoreClient
from engine.core.config import EngineConfig
from engine.core.engine.engine_core import EngineCore
from engine.core.messages import EngineDeadError
from engine.core.outputs import RequestOutput
from engine.core.startup import EngineSetup
from engine.sdk import IterationStats, SamplingParams, SchedulerStats, StatLogger
from engine.sdk.errors import ValidationError


class _Recorder(StatLogger):
    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.iterations: list[IterationStats] = []
        self.scheduler: list[SchedulerStats] = []

    def record(self, scheduler_stats: SchedulerStats | None,
               iteration_stats: IterationStats | None) -> None:
        if scheduler_stats is not None:
            self.scheduler.append(scheduler_stats)
        if iteration_stats is not None:
            self.iterations.append(iteration_stats)


class _Cores:
    """Builds EngineCores that count steps and can be told to fail."""

    def __init__(self) -> None:
        self.steps = 0
        self.fail_at_step: int | None = None
        self.fail_at_start = False

    def __call__(self, setup: EngineSetup, eos_token_id: int | None) -> EngineCore:
        if self.fail_at_start:
            raise RuntimeError("no weights today")
        core = EngineCore(setup, eos_token_id=eos_token_id)
        step = core.step

        def counted_step() -> Any:
            self.steps += 1
            if self.fail_at_step is not None and self.steps >= self.fail_at_step:
                raise RuntimeError("boom")
            return step()

        core.step = counted_step  # type: ignore[method-assign]
        return core


def _config(path: Path) -> EngineConfig:
    return EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64, plugins="none")


@pytest.fixture
async def engine(tiny_llama: Path) -> AsyncIterator[tuple[AsyncLLM, _Cores, _Recorder]]:
    cores = _Cores()
    recorders: list[_Recorder] = []

    def recorder(ctx: Any) -> _Recorder:
        recorders.append(_Recorder(ctx))
        return recorders[-1]

    llm = AsyncLLM(_config(tiny_llama), log_stats_interval=0,
                   client=lambda setup, eos: InProcessCoreClient(
                       setup, eos_token_id=eos, core_factory=cores),
                   stat_loggers={"recorder": recorder})
    await llm.start()
    yield llm, cores, recorders[0]
    await llm.shutdown()


async def _run(llm: AsyncLLM, request_id: str, prompt: Any, params: SamplingParams
               ) -> list[RequestOutput]:
    """The outputs yielded (one live object), checking only the last one is finished."""
    outputs, finished = [], []
    async for output in llm.generate(request_id, prompt, params):
        outputs.append(output)
        finished.append(output.finished)
    assert finished[-1] and not any(finished[:-1])
    return outputs


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


async def test_generate_matches_llm(engine: Any, tiny_llama: Path) -> None:
    llm, _, _ = engine
    prompts = ["Hello", "The quick brown fox", "abc"]
    results = await asyncio.gather(*(_run(llm, str(i), p, GREEDY)
                                     for i, p in enumerate(prompts)))
    offline = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, plugins="none",
                  in_process=True)
    expected = offline.generate(prompts, GREEDY, use_tqdm=False)
    for outputs, reference in zip(results, expected, strict=True):
        assert outputs[-1].outputs[0].token_ids == reference.outputs[0].token_ids
        assert outputs[-1].outputs[0].text == reference.outputs[0].text


async def test_validation_error_comes_before_any_output(engine: Any) -> None:
    llm, cores, _ = engine
    with pytest.raises(ValidationError) as info:
        await _run(llm, "long", "x" * 300, GREEDY)
    assert info.value.param == "prompt"
    assert cores.steps == 0 and not llm._streams


async def test_cancelling_the_consumer_aborts_and_frees_blocks(engine: Any) -> None:
    llm, _, recorder = engine
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in llm.generate("long", "Hello", SamplingParams(
                temperature=0.0, max_tokens=200, ignore_eos=True)):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    assert (await llm.get_stats()).num_running_reqs == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(50):
        stats = await llm.get_stats()
        if stats.num_running_reqs == 0 and stats.kv_cache_usage == 0:
            break
        await asyncio.sleep(0.02)
    assert (stats.num_running_reqs, stats.kv_cache_usage) == (0, 0)
    finished = [f for it in recorder.iterations for f in it.finished_requests]
    assert [(f.request_id, f.finish_reason) for f in finished] == [("long", "abort")]


async def test_stop_string_ends_the_request_in_engine_core(engine: Any) -> None:
    llm, _, _ = engine
    text = (await _run(llm, "a", "Hello", GREEDY.replace(max_tokens=16)))[-1].outputs[0].text
    stop = next(c for c in text[1:] if c.isascii() and c.isprintable())
    final = (await _run(llm, "b", "Hello", GREEDY.replace(stop=(stop,), max_tokens=16)))[-1]
    assert final.outputs[0].finish_reason == "stop"
    assert final.outputs[0].text == text[:text.index(stop)]
    stats = await llm.get_stats()
    assert stats.num_running_reqs == 0 and stats.kv_cache_usage == 0


async def test_iteration_stats(engine: Any) -> None:
    llm, _, recorder = engine
    await _run(llm, "s", "Hello", GREEDY.replace(n=2, max_tokens=5))
    iterations = recorder.iterations
    assert sum(it.num_generation_tokens for it in iterations) == 10
    assert sum(it.num_prompt_tokens for it in iterations) == 5
    assert sum(len(it.time_to_first_tokens) for it in iterations) == 2
    assert sum(len(it.inter_token_latencies) for it in iterations) == 8
    (done,) = [f for it in iterations for f in it.finished_requests]
    assert (done.request_id, done.finish_reason) == ("s", "length")
    assert (done.num_prompt_tokens, done.num_generation_tokens) == (5, 10)
    assert done.e2e_latency >= done.time_to_first_token > 0
    assert recorder.scheduler  # one SchedulerStats per step


async def test_idle_engine_does_not_step(engine: Any) -> None:
    llm, cores, _ = engine
    await _run(llm, "x", "Hi", GREEDY.replace(max_tokens=2))
    await asyncio.sleep(0.1)  # the step that tells the worker the request finished
    steps = cores.steps
    await asyncio.sleep(0.3)
    assert cores.steps == steps


async def test_engine_death_fails_requests_and_later_calls(engine: Any) -> None:
    llm, cores, _ = engine
    cores.fail_at_step = cores.steps + 3
    with pytest.raises(EngineDeadError) as info:
        await asyncio.wait_for(_run(llm, "doomed", "Hello", GREEDY.replace(max_tokens=50)), 30)
    assert isinstance(info.value.__cause__, RuntimeError) and "boom" in str(info.value)
    assert not await llm.is_healthy()
    with pytest.raises(EngineDeadError):
        llm.add_request("later", "Hi", GREEDY)
    with pytest.raises(EngineDeadError):
        await llm.get_stats()


async def test_start_failure_is_engine_dead(tiny_llama: Path) -> None:
    cores = _Cores()
    cores.fail_at_start = True
    llm = AsyncLLM(_config(tiny_llama), client=lambda setup, eos: InProcessCoreClient(
        setup, eos_token_id=eos, core_factory=cores))
    with pytest.raises(EngineDeadError, match="no weights today"):
        await asyncio.wait_for(llm.start(), 30)
    await llm.shutdown()


async def test_stat_logger_plugins_receive_stats(tiny_llama: Path, plugins_on_path: Path,
                                                 ) -> None:
    from engine_test_plugin_good.stats import CountingStatLogger

    before = CountingStatLogger.generation_tokens
    llm = AsyncLLM(_config(tiny_llama).model_copy(update={"plugins": "engine-test-plugin-good"}),
                   log_stats_interval=0, client=in_process_client)
    await llm.start()
    try:
        assert "test_good_counter" in llm.stat_loggers.loggers
        await _run(llm, "p", "Hello", GREEDY.replace(max_tokens=4))
    finally:
        await llm.shutdown()
    assert CountingStatLogger.generation_tokens - before == 4


def test_chat_template_override(tiny_llama: Path) -> None:
    config = _config(tiny_llama).model_copy(update={
        "chat_template": "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"})
    llm = AsyncLLM(config)  # not started: no weights are loaded
    assert llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "[hi]"


def test_logging_stat_logger_lines(caplog: pytest.LogCaptureFixture) -> None:
    from engine.core.client.stat_loggers import LoggingStatLogger
    from engine.sdk.stat_logger import StatLoggerContext
    from engine.sdk.stats import FinishedRequestStats

    stat_logger = LoggingStatLogger(StatLoggerContext(model="m"))
    caplog.set_level("INFO", logger="engine.stats")
    stat_logger.log()
    assert not caplog.records  # idle: no throughput line
    stat_logger.record(SchedulerStats(num_running_reqs=1, kv_cache_usage=0.25), IterationStats(
        timestamp=0.0, num_prompt_tokens=7, num_generation_tokens=3,
        finished_requests=(FinishedRequestStats("r1", "stop", 7, 3, 0.5, 0.1),)))
    stat_logger.log()
    finished, throughput = (r.getMessage() for r in caplog.records)
    assert "r1" in finished and "finish_reason=stop" in finished and "latency=0.500s" in finished
    assert "generation throughput" in throughput and "KV cache usage: 25.0%" in throughput
    assert "External" not in throughput  # no KV connector


def test_logging_stat_logger_reports_the_connector_hit_rate(
        caplog: pytest.LogCaptureFixture) -> None:
    from engine.core.client.stat_loggers import LoggingStatLogger
    from engine.sdk.stat_logger import StatLoggerContext
    from engine.sdk.stats import PrefixCacheStats

    stat_logger = LoggingStatLogger(StatLoggerContext(model="m"))
    caplog.set_level("INFO", logger="engine.stats")
    for local, external in (((16, 4), (12, 3)), ((16, 0), (16, 13))):
        stat_logger.record(SchedulerStats(
            num_running_reqs=1, prefix_cache=PrefixCacheStats(*local),
            connector_prefix_cache=PrefixCacheStats(*external)), None)
    stat_logger.log()
    (line,) = (r.getMessage() for r in caplog.records)
    assert line.endswith("Prefix cache hit rate: 12.5%, External prefix cache hit rate: 57.1%")
