"""A plugin built against engine-plugin-sdk 2.x (a future major version)."""

from __future__ import annotations

from engine.sdk import IterationStats, SchedulerStats, StatLogger


class FutureStatLogger(StatLogger):
    """Declares the contract it was written for: SDK 2.0."""

    sdk_version = "2.0.0"

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None:
        pass
