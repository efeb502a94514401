"""A stat logger that counts what it receives."""

from __future__ import annotations

from engine.sdk import IterationStats, SchedulerStats, StatLogger


class CountingStatLogger(StatLogger):
    """Counts records, generated tokens and shutdowns (observable by tests)."""

    records = 0
    generation_tokens = 0
    shutdowns = 0
    #: ``records`` when the last ``shutdown()`` ran (no record may come after it).
    records_at_shutdown = -1

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None:
        type(self).records += 1
        if iteration_stats is not None:
            type(self).generation_tokens += iteration_stats.num_generation_tokens

    def shutdown(self) -> None:
        type(self).shutdowns += 1
        type(self).records_at_shutdown = type(self).records
