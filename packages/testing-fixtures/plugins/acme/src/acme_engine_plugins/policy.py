"""``engine.scheduling_policies`` entry ``acme_shortest_job``: shortest job first.

A request's job is its prompt plus the tokens it may still generate (``max_tokens``; a
request without one counts as ``unbounded_tokens``). Waiting requests start shortest job
first, arrival order breaking ties; when blocks run out, the running request with the most
work left is preempted (its recompute wastes the least of what others need).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from pydantic import Field

from engine.sdk import PluginOptions, RequestView, SchedulingPolicy, SchedulingPolicyContext


class ShortestJobFirst(SchedulingPolicy):
    """Shortest job (prompt + max_tokens) first; preempts the job with the most work left."""

    name = "acme_shortest_job"

    class Options(PluginOptions):
        unbounded_tokens: int = Field(
            4096, ge=1, description="tokens assumed for a request without max_tokens")

    def __init__(self, ctx: SchedulingPolicyContext) -> None:
        super().__init__(ctx)
        self.options = cast(ShortestJobFirst.Options, ctx.options)

    def _max_tokens(self, request: RequestView) -> int:
        limit = request.sampling_params.max_tokens
        return self.options.unbounded_tokens if limit is None else limit

    def sort_key(self, request: RequestView) -> tuple[Any, ...]:
        return (request.num_prompt_tokens + self._max_tokens(request), request.arrival_time)

    def select_preemption_victim(self, running: Sequence[RequestView]) -> RequestView:
        def work_left(request: RequestView) -> tuple[int, float]:
            generated = request.num_tokens - request.num_prompt_tokens
            return (self._max_tokens(request) - generated, request.arrival_time)

        return max(running, key=work_left)
