"""Stats types handed to stat loggers. Versioned with the SDK: fields are only ever added.

.. versionadded:: 1.0
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixCacheStats:
    """Prefix-cache lookups since the previous snapshot.

    Attributes:
        queries: Prompt tokens looked up.
        hits: Of those, tokens found in the cache (the prefix cache, or supplied by a KV
            connector from outside the engine).
        reset: True if the cache was reset since the previous snapshot.

    .. versionadded:: 1.0
    """

    queries: int = 0
    hits: int = 0
    reset: bool = False


@dataclass(frozen=True)
class SchedulerStats:
    """The scheduler's state after a step (made by ``SchedulerInterface.make_stats``).

    Attributes:
        num_running_reqs: Requests running.
        num_waiting_reqs: Requests waiting.
        kv_cache_usage: Fraction of KV blocks in use, in [0, 1].
        num_free_blocks: KV blocks free (evictable cached blocks count as free).
        num_total_blocks: KV blocks in the pool.
        prefix_cache: Lookups since the previous snapshot.
        num_preempted_reqs: Requests preempted since the previous snapshot.

    .. versionadded:: 1.0
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache: PrefixCacheStats = PrefixCacheStats()
    num_preempted_reqs: int = 0


@dataclass(frozen=True)
class FinishedRequestStats:
    """One request that finished in the iteration.

    Attributes:
        request_id: The request.
        finish_reason: ``"stop"``, ``"length"``, ``"abort"`` or ``"error"`` (a plugin
            failed it; since 1.1).
        num_prompt_tokens: Prompt length.
        num_generation_tokens: Tokens generated.
        e2e_latency: Seconds from arrival to the last token.
        time_to_first_token: Seconds from arrival to the first token (0 if none).
        queued_time: Seconds spent waiting before the first schedule.

    .. versionadded:: 1.0
    """

    request_id: str
    finish_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency: float
    time_to_first_token: float = 0.0
    queued_time: float = 0.0


@dataclass(frozen=True)
class IterationStats:
    """What happened in one batch of outputs handled by the front end.

    Attributes:
        timestamp: ``time.time()`` when the outputs were handled.
        num_prompt_tokens: Prompt tokens whose first output arrived in this iteration.
        num_generation_tokens: Tokens generated in this iteration.
        time_to_first_tokens: TTFT of each request that got its first token, seconds.
        inter_token_latencies: Seconds between consecutive tokens of running requests.
        finished_requests: Requests that finished.

    .. versionadded:: 1.0
    """

    timestamp: float
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: tuple[float, ...] = ()
    inter_token_latencies: tuple[float, ...] = ()
    finished_requests: tuple[FinishedRequestStats, ...] = ()
