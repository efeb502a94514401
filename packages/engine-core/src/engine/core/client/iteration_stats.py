"""Per-request timing in the front end, turned into one ``IterationStats`` per step.

EngineCore reports tokens, not times. The front end knows when each request arrived and
when each step's outputs reached it, so it measures what users feel:

* time to first token (TTFT): first token of a request's first choice minus its arrival;
* inter-token latency: time between two steps that gave a choice new tokens (one sample per
  step and choice, as vLLM counts it);
* end-to-end latency: the request finished (all choices) minus its arrival.

Engine requests are choices (``n > 1`` fans out); TTFT and inter-token latency are sampled
per choice, prompt tokens and finished-request records per request.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.core.outputs import RequestOutput
from engine.sdk.scheduler import EngineCoreOutput
from engine.sdk.stats import FinishedRequestStats, IterationStats


@dataclass
class _RequestTimes:
    arrival_time: float
    num_prompt_tokens: int
    choice_ids: tuple[str, ...]
    first_token_time: float | None = None


@dataclass
class _ChoiceTimes:
    parent_id: str
    last_token_time: float | None = None


@dataclass
class _Pending:
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


def finish_reason_of(output: RequestOutput) -> str:
    """One finish reason for a whole request (its choices may differ).

    ``error`` if a plugin failed a choice, else ``abort`` if a choice aborted, else
    ``length`` if one ran out of tokens, else ``stop``.
    """
    reasons = {c.finish_reason for c in output.outputs}
    for reason in ("error", "abort", "length"):
        if reason in reasons:
            return reason
    return "stop"


class IterationStatsTracker:
    """Tracks the requests in flight; :meth:`take` returns what happened since the last call."""

    def __init__(self) -> None:
        self._requests: dict[str, _RequestTimes] = {}
        self._choices: dict[str, _ChoiceTimes] = {}
        self._pending = _Pending()

    def add_request(self, request_id: str, choice_ids: Iterable[str], num_prompt_tokens: int,
                    arrival_time: float) -> None:
        """Start timing a request whose choices have the engine ids ``choice_ids``."""
        choice_ids = tuple(choice_ids)
        self._requests[request_id] = _RequestTimes(arrival_time, num_prompt_tokens, choice_ids)
        for choice_id in choice_ids:
            self._choices[choice_id] = _ChoiceTimes(request_id)

    def on_outputs(self, outputs: Iterable[EngineCoreOutput], now: float) -> None:
        """Account one step's outputs, received at ``now``."""
        pending = self._pending
        for out in outputs:
            choice = self._choices.get(out.request_id)
            if choice is None or not out.new_token_ids:
                continue
            request = self._requests[choice.parent_id]
            pending.num_generation_tokens += len(out.new_token_ids)
            if choice.last_token_time is None:
                pending.time_to_first_tokens.append(now - request.arrival_time)
                if request.first_token_time is None:
                    request.first_token_time = now
                    pending.num_prompt_tokens += request.num_prompt_tokens
            else:
                pending.inter_token_latencies.append(now - choice.last_token_time)
            choice.last_token_time = now

    def finish(self, output: RequestOutput, now: float, reason: str | None = None) -> None:
        """Record a finished (or aborted) request and stop timing it."""
        request = self._requests.pop(output.request_id, None)
        if request is None:
            return
        for choice_id in request.choice_ids:
            self._choices.pop(choice_id, None)
        first = request.first_token_time
        self._pending.finished_requests.append(FinishedRequestStats(
            request_id=output.request_id,
            finish_reason=reason or finish_reason_of(output),
            num_prompt_tokens=request.num_prompt_tokens,
            num_generation_tokens=sum(len(c.token_ids) for c in output.outputs),
            e2e_latency=now - request.arrival_time,
            time_to_first_token=0.0 if first is None else first - request.arrival_time,
        ))

    def take(self, now: float) -> IterationStats:
        """The stats gathered since the previous call."""
        pending, self._pending = self._pending, _Pending()
        return IterationStats(
            timestamp=now,
            num_prompt_tokens=pending.num_prompt_tokens,
            num_generation_tokens=pending.num_generation_tokens,
            time_to_first_tokens=tuple(pending.time_to_first_tokens),
            inter_token_latencies=tuple(pending.inter_token_latencies),
            finished_requests=tuple(pending.finished_requests),
        )
