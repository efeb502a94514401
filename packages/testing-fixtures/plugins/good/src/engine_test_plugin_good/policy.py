"""A scheduling policy: last come, first served (observably different from fcfs)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.sdk import RequestView, SchedulingPolicy


class LastComeFirstServed(SchedulingPolicy):
    """Newest waiting request first; preempts the oldest running request.

    A request with ``extra_args={"test_good_lifo_first": true}`` goes before the others: the
    policy declares the key (SDK 1.1), so the front end accepts it.
    """

    name = "test_good_lifo"
    extra_args_keys = frozenset({"test_good_lifo_first"})

    def sort_key(self, request: RequestView) -> tuple[Any, ...]:
        first = bool((request.sampling_params.extra_args or {}).get("test_good_lifo_first"))
        return (not first, -request.arrival_time)

    def select_preemption_victim(self, running: Sequence[RequestView]) -> RequestView:
        return min(running, key=lambda r: r.arrival_time)
