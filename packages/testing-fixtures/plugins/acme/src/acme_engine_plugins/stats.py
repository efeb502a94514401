"""``engine.stat_loggers`` entry ``acme_jsonl``: one JSON line per finished request.

``--plugin-option acme_jsonl.path=/var/log/engine/requests.jsonl`` appends, for every
finished request, ``{"request_id", "finish_reason", "prompt_tokens", "generation_tokens",
"e2e_latency", "ttft", "queued", "engine"}``. Lines are buffered by ``record`` (which runs
on the server's event loop and must not block) and written by ``log`` (every few seconds)
and ``shutdown``. Without a path nothing is written; the totals (requests by finish
reason, prefix-cache lookups and hits, peak KV-cache usage) are kept either way.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, cast

from pydantic import Field

from engine.sdk import IterationStats, PluginOptions, SchedulerStats, StatLogger, StatLoggerContext


class JsonlRequestLogger(StatLogger):
    """Appends finished requests to a JSON-lines file; counts them by finish reason."""

    class Options(PluginOptions):
        path: str | None = Field(None, description="file to append to; none: write nothing")

    def __init__(self, ctx: StatLoggerContext) -> None:
        super().__init__(ctx)
        path = cast(JsonlRequestLogger.Options, ctx.options).path
        self.path = None if path is None else Path(path)
        self.lines: list[str] = []
        self.finished: Counter[str] = Counter()  # finish reason -> requests
        self.max_kv_cache_usage = 0.0
        self.prefix_cache_queries = 0  # prompt tokens looked up, since start
        self.prefix_cache_hits = 0  # of those, found in the engine's own prefix cache
        self.connector_hits = 0  # prompt tokens a KV connector supplied, since start

    def record(self, scheduler_stats: SchedulerStats | None,
               iteration_stats: IterationStats | None) -> None:
        if scheduler_stats is not None:
            self.max_kv_cache_usage = max(self.max_kv_cache_usage,
                                          scheduler_stats.kv_cache_usage)
            self.prefix_cache_queries += scheduler_stats.prefix_cache.queries
            self.prefix_cache_hits += scheduler_stats.prefix_cache.hits
            if scheduler_stats.connector_prefix_cache is not None:  # a connector is selected
                self.connector_hits += scheduler_stats.connector_prefix_cache.hits
        if iteration_stats is None:
            return
        for done in iteration_stats.finished_requests:
            self.finished[done.finish_reason] += 1
            line: dict[str, Any] = {
                "request_id": done.request_id, "finish_reason": done.finish_reason,
                "prompt_tokens": done.num_prompt_tokens,
                "generation_tokens": done.num_generation_tokens,
                "e2e_latency": done.e2e_latency, "ttft": done.time_to_first_token,
                "queued": done.queued_time, "engine": self.ctx.engine_index}
            if self.path is not None:
                self.lines.append(json.dumps(line))

    def log(self) -> None:
        lines, self.lines = self.lines, []
        if lines and self.path is not None:
            with self.path.open("a", encoding="utf-8") as file:
                file.write("".join(f"{line}\n" for line in lines))

    def shutdown(self) -> None:
        self.log()  # what record() buffered since the last log()
