"""``SchedulingPolicy``: the small, stable way to change how the default scheduler decides.

A policy answers three questions for the default scheduler and nothing else:

* in which order waiting requests are considered (:meth:`SchedulingPolicy.sort_key`);
* whether a waiting request may be admitted now (:meth:`SchedulingPolicy.can_admit`);
* which running request to preempt when KV blocks run out
  (:meth:`SchedulingPolicy.select_preemption_victim`).

Block accounting, chunked prefill and stop checks stay in the engine, so a policy cannot
leak blocks. Built-ins: ``fcfs`` (default) and ``priority`` (lower ``priority`` first).

.. versionadded:: 1.0
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from engine.sdk.context import PluginContext
from engine.sdk.plugin import Plugin
from engine.sdk.scheduler import RequestView


@dataclass(frozen=True)
class SchedulerState:
    """The scheduler's load when an admission decision is made.

    Attributes:
        num_running: Requests currently running.
        num_waiting: Requests waiting (including the candidate).
        num_free_blocks: KV blocks free (or evictable from the prefix cache).
        num_total_blocks: KV blocks in the pool.
        num_scheduled_tokens: Tokens already scheduled in the step being built.
        token_budget: Tokens still available in that step.

    .. versionadded:: 1.0
    """

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_scheduled_tokens: int
    token_budget: int


@dataclass(frozen=True, kw_only=True)
class SchedulingPolicyContext(PluginContext):
    """What a policy is told at construction.

    Attributes:
        max_num_seqs: Most requests in one step.
        max_num_batched_tokens: Most tokens in one step.
        num_kv_blocks: KV blocks in the pool.

    .. versionadded:: 1.0
    """

    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    num_kv_blocks: int = 0


class SchedulingPolicy(Plugin, ABC):
    """Ordering, admission and preemption decisions for the default scheduler.

    Called: by the default scheduler on the EngineCore thread, during ``schedule()``; many
    times per step. Keep every method cheap and free of side effects on the requests.

    Example::

        class ShortestFirst(SchedulingPolicy):
            name = "shortest_first"

            def sort_key(self, request):
                return (request.num_prompt_tokens, request.arrival_time)

            def select_preemption_victim(self, running):
                return max(running, key=lambda r: r.num_prompt_tokens)

    .. versionadded:: 1.0
    """

    name: ClassVar[str]

    def __init__(self, ctx: SchedulingPolicyContext) -> None:
        self.ctx = ctx

    @abstractmethod
    def sort_key(self, request: RequestView) -> tuple[Any, ...]:
        """Key of a waiting request: waiting requests are considered in ascending key order.

        Called: when a request enters the waiting queue (or re-enters after preemption);
        the key must not depend on anything that changes while the request waits.
        """

    def can_admit(self, request: RequestView, state: SchedulerState) -> bool:
        """Whether ``request`` (the head of the waiting order) may start now.

        Called: once per candidate per step, after the engine checked that blocks and token
        budget suffice. Returning False stops admission for this step (head-of-line).
        Default: always True.
        """
        return True

    @abstractmethod
    def select_preemption_victim(self, running: Sequence[RequestView]) -> RequestView:
        """Pick the running request to preempt when KV blocks run out.

        Called: while the scheduler cannot allocate a block for a running request; possibly
        several times per step. ``running`` is never empty.
        Must: return an element of ``running``. The victim's blocks are freed and it is
        recomputed later (preemption by recompute).
        """
