"""Stat-logger plugin: running totals of the engine's stats, kept in memory.

:data:`TOTALS` is what this distribution's endpoint (``GET /sdk1/stats``) serves.
``record`` only adds numbers (cheap, no I/O).
"""

from __future__ import annotations

from collections import deque
from typing import Any, ClassVar

from pydantic import Field

from engine.sdk import (
    IterationStats,
    PluginOptions,
    SchedulerStats,
    StatLogger,
    StatLoggerContext,
)
from engine_test_plugin_sdk1.counters import count

#: Totals across every engine of this process.
TOTALS: dict[str, Any] = {
    "records": 0, "prompt_tokens": 0, "generation_tokens": 0, "finished": {},
    "max_running": 0, "max_kv_cache_usage": 0.0, "preempted": 0, "prefix_cache_queries": 0,
    "engines": [],
}

#: The last finished requests, newest last: (request id, reason, generated tokens).
RECENT: deque[tuple[str, str, int]] = deque(maxlen=1000)


class Sdk1TotalsLogger(StatLogger):
    name: ClassVar[str] = "sdk1_totals"

    class Options(PluginOptions):
        keep_recent: int = Field(100, ge=0, le=1000,
                                 description="finished requests remembered in RECENT")

    def __init__(self, ctx: StatLoggerContext) -> None:
        super().__init__(ctx)
        options = ctx.options
        if not isinstance(options, Sdk1TotalsLogger.Options):
            options = Sdk1TotalsLogger.Options()  # built outside the engine
        self.keep_recent = options.keep_recent

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None:
        count("sdk1_totals.record")
        TOTALS["records"] += 1
        if scheduler_stats is not None:
            TOTALS["max_running"] = max(TOTALS["max_running"], scheduler_stats.num_running_reqs)
            TOTALS["max_kv_cache_usage"] = max(TOTALS["max_kv_cache_usage"],
                                               scheduler_stats.kv_cache_usage)
            TOTALS["preempted"] += scheduler_stats.num_preempted_reqs
            TOTALS["prefix_cache_queries"] += scheduler_stats.prefix_cache.queries
        if iteration_stats is None:
            return
        TOTALS["prompt_tokens"] += iteration_stats.num_prompt_tokens
        TOTALS["generation_tokens"] += iteration_stats.num_generation_tokens
        for done in iteration_stats.finished_requests:
            finished = TOTALS["finished"]
            finished[done.finish_reason] = finished.get(done.finish_reason, 0) + 1
            if self.keep_recent:
                RECENT.append((done.request_id, done.finish_reason, done.num_generation_tokens))
                while len(RECENT) > self.keep_recent:
                    RECENT.popleft()

    def log_engine_initialized(self) -> None:
        count("sdk1_totals.log_engine_initialized")
        ctx = self.ctx
        TOTALS["engines"].append({"model": ctx.model, "engine_index": ctx.engine_index,
                                  "max_model_len": ctx.max_model_len,
                                  "num_kv_blocks": ctx.num_kv_blocks,
                                  "block_size": ctx.block_size})
