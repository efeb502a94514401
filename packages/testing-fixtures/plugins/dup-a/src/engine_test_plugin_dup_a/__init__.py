"""One of two distributions that both claim engine.scheduling_policies:test_dup_policy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.sdk import RequestView, SchedulingPolicy


class Policy(SchedulingPolicy):
    """First come, first served (the body does not matter: the name clash does)."""

    name = "test_dup_policy"

    def sort_key(self, request: RequestView) -> tuple[Any, ...]:
        return (request.arrival_time,)

    def select_preemption_victim(self, running: Sequence[RequestView]) -> RequestView:
        return running[-1]
