"""Scheduling-policy plugin: shortest prompt first, with an optional cap on running requests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from pydantic import Field

from engine.sdk import (
    PluginOptions,
    RequestView,
    SchedulerState,
    SchedulingPolicy,
    SchedulingPolicyContext,
)
from engine_test_plugin_sdk1.counters import count


class Sdk1ShortestFirst(SchedulingPolicy):
    """Waiting requests by prompt length, then arrival; preempts the longest running one."""

    name: ClassVar[str] = "sdk1_shortest_first"

    class Options(PluginOptions):
        max_running: int = Field(0, ge=0, description="admit none while this many run; 0: no cap")

    def __init__(self, ctx: SchedulingPolicyContext) -> None:
        super().__init__(ctx)
        options = ctx.options
        if not isinstance(options, Sdk1ShortestFirst.Options):
            options = Sdk1ShortestFirst.Options()  # built outside the engine
        self.max_running = options.max_running

    def sort_key(self, request: RequestView) -> tuple[Any, ...]:
        count("sdk1_shortest_first.sort_key")
        return (request.num_prompt_tokens, request.arrival_time, request.request_id)

    def can_admit(self, request: RequestView, state: SchedulerState) -> bool:
        count("sdk1_shortest_first.can_admit")
        return self.max_running == 0 or state.num_running < self.max_running

    def select_preemption_victim(self, running: Sequence[RequestView]) -> RequestView:
        count("sdk1_shortest_first.select_preemption_victim")
        return max(running, key=lambda r: (r.num_tokens, r.arrival_time))
