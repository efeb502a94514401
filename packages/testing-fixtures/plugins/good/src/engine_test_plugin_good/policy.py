"""A scheduling policy: last come, first served (observably different from fcfs)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.sdk import RequestView, SchedulingPolicy


class LastComeFirstServed(SchedulingPolicy):
    """Newest waiting request first; preempts the oldest running request."""

    name = "test_good_lifo"

    def sort_key(self, request: RequestView) -> tuple[Any, ...]:
        return (-request.arrival_time,)

    def select_preemption_victim(self, running: Sequence[RequestView]) -> RequestView:
        return min(running, key=lambda r: r.arrival_time)
