"""``WaitingQueue``: waiting requests ordered by the policy's sort key.

A binary heap of ``(sort_key, seq, request)``: push and pop in O(log n), peek in O(1).
``seq`` (insertion order, unique) breaks ties, so requests themselves are never compared.
Removal from the middle (an abort) is lazy: the entry stays in the heap and is dropped
when it reaches the top, recognised by its request no longer being waiting; the live
count is kept separately so ``len`` is exact.
"""

from __future__ import annotations

import heapq
from typing import Any

from engine.core.scheduler.request import Request
from engine.sdk.scheduler import RequestStatus
from engine.sdk.scheduling_policy import SchedulingPolicy

_WAITING_STATES = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


class WaitingQueue:
    """Requests waiting for admission, in policy order.

    Args:
        policy: Supplies :meth:`~engine.sdk.scheduling_policy.SchedulingPolicy.sort_key`.
    """

    def __init__(self, policy: SchedulingPolicy) -> None:
        self._policy = policy
        self._heap: list[tuple[tuple[Any, ...], int, Request]] = []
        self._num_requests = 0

    def __len__(self) -> int:
        return self._num_requests

    def __bool__(self) -> bool:
        return self._num_requests > 0

    def push(self, request: Request) -> None:
        """Add a request whose status is WAITING or PREEMPTED."""
        key = tuple(self._policy.sort_key(request))
        heapq.heappush(self._heap, (key, request.seq, request))
        self._num_requests += 1

    def peek(self) -> Request:
        """The first request in policy order.

        Raises:
            IndexError: the queue is empty.
        """
        heap = self._heap
        while heap and heap[0][2].status not in _WAITING_STATES:
            heapq.heappop(heap)
        if not heap:
            raise IndexError("peek from an empty waiting queue")
        return heap[0][2]

    def pop(self) -> Request:
        """Remove and return the first request in policy order."""
        request = self.peek()
        heapq.heappop(self._heap)
        self._num_requests -= 1
        return request

    def remove(self, request: Request) -> None:
        """Forget a queued request (an abort); the caller then gives it a final status."""
        self._num_requests -= 1
