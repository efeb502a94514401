"""acme_jsonl: one line per finished request, written from log() and shutdown()."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from acme_engine_plugins.stats import JsonlRequestLogger

from engine.sdk import (
    FinishedRequestStats,
    IterationStats,
    PrefixCacheStats,
    SchedulerStats,
    StatLoggerContext,
)


def make(path: Path | None) -> JsonlRequestLogger:
    options = JsonlRequestLogger.Options(path=None if path is None else str(path))
    return JsonlRequestLogger(StatLoggerContext(options=options, engine_index=2))


def finished(request_id: str, reason: str = "stop") -> IterationStats:
    done = FinishedRequestStats(request_id, reason, num_prompt_tokens=5,
                                num_generation_tokens=3, e2e_latency=0.25,
                                time_to_first_token=0.05)
    return IterationStats(timestamp=0.0, finished_requests=(done,))


def test_buffers_in_record_writes_in_log_and_shutdown(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    logger = make(path)
    logger.record(SchedulerStats(kv_cache_usage=0.5,
                                 prefix_cache=PrefixCacheStats(queries=10, hits=4)),
                  finished("a"))
    logger.record(None, None)  # either argument may be None
    assert not path.exists()  # record() never writes
    logger.log()
    logger.record(None, finished("b", "length"))
    logger.shutdown()  # what log() has not written yet
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(x["request_id"], x["finish_reason"], x["engine"]) for x in lines] == [
        ("a", "stop", 2), ("b", "length", 2)]
    assert lines[0]["generation_tokens"] == 3 and lines[0]["ttft"] == 0.05
    assert logger.finished == {"stop": 1, "length": 1} and logger.max_kv_cache_usage == 0.5
    assert (logger.prefix_cache_queries, logger.prefix_cache_hits) == (10, 4)


def test_without_a_path_it_writes_nothing(tmp_path: Path) -> None:
    logger = make(None)
    logger.record(None, finished("a"))
    logger.shutdown()
    assert logger.finished == {"stop": 1} and list(tmp_path.iterdir()) == []


def test_the_engine_feeds_it(tiny_qwen3: Path, make_llm: Callable[..., Any],
                             greedy: Callable[..., Any], tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    with make_llm(tiny_qwen3, plugin_options={"acme_jsonl": {"path": str(path)}}) as llm:
        greedy(llm, [[5, 6, 7], [8, 9]], max_tokens=4)
    lines = [json.loads(line) for line in path.read_text().splitlines()]  # flushed at shutdown
    assert sorted((x["prompt_tokens"], x["generation_tokens"], x["finish_reason"])
                  for x in lines) == [(2, 4, "length"), (3, 4, "length")]


def test_left_out_by_the_allowlist_it_is_never_built(
    tiny_qwen3: Path, make_llm: Callable[..., Any], spy: Callable[..., Any],
    greedy: Callable[..., Any],
) -> None:
    calls = spy(JsonlRequestLogger, "record")
    with make_llm(tiny_qwen3, plugins="models:Qwen3ForCausalLM") as llm:  # only the model
        greedy(llm, [[5, 6, 7]], max_tokens=2)
    assert calls["record"] == 0


@pytest.mark.parametrize("options", [{"pth": "x"}, {"path": 3}])
def test_bad_options_stop_start_up_naming_the_plugin(
    tiny_qwen3: Path, make_llm: Callable[..., Any], options: dict[str, Any],
) -> None:
    from engine.sdk import PluginError

    with pytest.raises(PluginError, match=r"plugin 'acme_jsonl' \(group engine.stat_loggers, "
                                          r"distribution acme-engine-plugins"):
        make_llm(tiny_qwen3, plugin_options={"acme_jsonl": options})
