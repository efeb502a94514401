"""The built-in scheduling policies: ``fcfs`` (the default) and ``priority``.

Both order waiting requests by a key computed once when the request enters the waiting
queue; the scheduler breaks ties by insertion order (``add_request`` order), which a
preempted request keeps. Both preempt the least important running request; among equals,
the one admitted last (latest in the running order), as vLLM pops the running queue's tail.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.sdk.scheduler import RequestView
from engine.sdk.scheduling_policy import SchedulingPolicy


class FCFSPolicy(SchedulingPolicy):
    """First come, first served: earliest ``arrival_time`` first; preempt the latest arrival.

    Example::

        --scheduling-policy fcfs
    """

    name = "fcfs"

    def sort_key(self, request: RequestView) -> tuple[Any, ...]:
        """Order by arrival time."""
        return (request.arrival_time,)

    def select_preemption_victim(self, running: Sequence[RequestView]) -> RequestView:
        """The running request that arrived last (the latest admitted among equal times)."""
        return max(reversed(running), key=_arrival_time)


class PriorityPolicy(SchedulingPolicy):
    """Lowest ``priority`` value first, then earliest arrival; preempt the opposite end.

    Example::

        --scheduling-policy priority
    """

    name = "priority"

    def sort_key(self, request: RequestView) -> tuple[Any, ...]:
        """Order by (priority, arrival time): lower values are scheduled first."""
        return (request.priority, request.arrival_time)

    def select_preemption_victim(self, running: Sequence[RequestView]) -> RequestView:
        """The running request with the largest (priority, arrival time)."""
        return max(reversed(running), key=_priority_and_arrival)


def _arrival_time(request: RequestView) -> float:
    return request.arrival_time


def _priority_and_arrival(request: RequestView) -> tuple[int, float]:
    return (request.priority, request.arrival_time)
