"""A stat logger that counts what it receives."""

from __future__ import annotations

from engine.sdk import IterationStats, SchedulerStats, StatLogger


class CountingStatLogger(StatLogger):
    """Counts records and generated tokens (observable by tests)."""

    records = 0
    generation_tokens = 0

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None:
        type(self).records += 1
        if iteration_stats is not None:
            type(self).generation_tokens += iteration_stats.num_generation_tokens
