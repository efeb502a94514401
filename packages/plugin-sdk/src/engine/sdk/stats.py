"""Stats types handed to stat loggers. Versioned with the SDK: fields are only ever added.

.. versionadded:: 1.0
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixCacheStats:
    """Prefix-cache lookups since the previous snapshot, counted at each admission.

    One type for two caches (as vLLM has): ``SchedulerStats.prefix_cache`` is the engine's
    own prefix cache, ``SchedulerStats.connector_prefix_cache`` what a KV connector was
    asked for. A cached prompt token is a hit in exactly one of them.

    Attributes:
        queries: Prompt tokens looked up (in the connector's: the tokens past the local
            hits, which are what the connector is asked about).
        hits: Of those, tokens found (in the connector's: the tokens it supplied).
        reset: True if the cache was reset since the previous snapshot (always False for
            the connector's).

    .. versionadded:: 1.0
    .. versionchanged:: 1.1
       Tokens a KV connector supplies are counted in ``connector_prefix_cache``, not in
       ``prefix_cache`` (1.0 added them to ``prefix_cache.hits`` when the local prefix
       cache was on, and nowhere when it was off).
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
        prefix_cache: Lookups in the engine's own prefix cache since the previous
            snapshot (all zero when ``--enable-prefix-caching`` is off).
        num_preempted_reqs: Requests preempted since the previous snapshot.
        connector_prefix_cache: Lookups through the KV connector since the previous
            snapshot: ``queries`` are the prompt tokens past the local hits that the
            connector was asked about, ``hits`` the tokens it supplied. ``None`` when no
            KV connector is selected (``--kv-connector``).

    .. versionadded:: 1.0
    .. versionchanged:: 1.1 Added ``connector_prefix_cache``.
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache: PrefixCacheStats = PrefixCacheStats()
    num_preempted_reqs: int = 0
    connector_prefix_cache: PrefixCacheStats | None = None


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
