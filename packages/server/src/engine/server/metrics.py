"""Prometheus metrics: a built-in ``StatLogger`` and ``GET /metrics``.

Names follow vLLM's with the ``engine:`` prefix, so dashboards port by renaming::

    engine:num_requests_running           gauge      requests in the running batch
    engine:num_requests_waiting           gauge      requests waiting to be scheduled
    engine:kv_cache_usage_perc            gauge      fraction of KV blocks in use (0..1)
    engine:num_preemptions_total          counter    requests preempted
    engine:prefix_cache_queries_total     counter    prompt tokens looked up in the prefix cache
    engine:prefix_cache_hits_total        counter    of those, tokens found
    engine:external_prefix_cache_queries_total
                                          counter    prompt tokens (past the local hits) the
                                                     KV connector was asked about
    engine:external_prefix_cache_hits_total
                                          counter    of those, tokens the connector supplied
    engine:prompt_tokens_total            counter    prompt tokens processed
    engine:generation_tokens_total        counter    tokens generated
    engine:request_success_total          counter    finished requests, label finished_reason
                                                     (stop, length, abort)
    engine:time_to_first_token_seconds    histogram
    engine:inter_token_latency_seconds    histogram
    engine:e2e_request_latency_seconds    histogram
    engine:request_prompt_tokens          histogram  prompt length of finished requests
    engine:request_generation_tokens      histogram  generated tokens of finished requests
    engine:engine_alive                   gauge      1 while EngineCore serves, 0 once it died
                                                     (or the server is shutting down)

Every metric has the label ``model_name``: the served model name (the first
``--served-model-name``, else the model's name), as vLLM's dashboards expect. Each server
has its own registry (no global state); ``/metrics`` refreshes the gauges from EngineCore
before rendering, so they are current even when the engine is idle. Once EngineCore died,
the running, waiting and KV-cache gauges read 0 (nothing holds them any more) and
``engine:engine_alive`` 0; the counters keep what was counted.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from engine.core.messages import EngineDeadError
from engine.sdk.stat_logger import StatLogger, StatLoggerContext
from engine.sdk.stats import IterationStats, SchedulerStats
from engine.server.state import server_state

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


def _token_buckets(max_model_len: int) -> tuple[float, ...]:
    buckets: list[float] = []
    value = 1
    while value < max_model_len:
        buckets.extend(b for b in (value, 2 * value, 5 * value) if b < max_model_len)
        value *= 10
    return (*buckets, float(max_model_len))


class PrometheusStatLogger(StatLogger):
    """Exports the engine's stats to a Prometheus registry (see the module docstring).

    Args:
        ctx: The stat-logger context.
        registry: Where the metrics live (``/metrics`` renders it).
    """

    def __init__(self, ctx: StatLoggerContext, registry: CollectorRegistry) -> None:
        super().__init__(ctx)
        self.registry = registry
        labels = ["model_name"]
        model = {"model_name": ctx.model}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=registry).labels(**model)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=registry).labels(**model)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets,
                             registry=registry).labels(**model)

        self.running = gauge("engine:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("engine:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("engine:kv_cache_usage_perc",
                              "Fraction of KV-cache blocks in use (1 = full).")
        self.preemptions = counter("engine:num_preemptions", "Requests preempted.")
        self.prefix_queries = counter("engine:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("engine:prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache.")
        self.external_queries = counter(
            "engine:external_prefix_cache_queries",
            "Prompt tokens past the prefix-cache hits looked up through the KV connector.")
        self.external_hits = counter("engine:external_prefix_cache_hits",
                                     "Prompt tokens the KV connector supplied.")
        self.prompt_tokens = counter("engine:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("engine:generation_tokens", "Tokens generated.")
        success = Counter("engine:request_success", "Finished requests by finish reason.",
                          [*labels, "finished_reason"], registry=registry)
        self.finished = {reason: success.labels(finished_reason=reason, **model)
                         for reason in FINISH_REASONS}
        self.ttft = histogram("engine:time_to_first_token_seconds",
                              "Time to first token, seconds.", TTFT_BUCKETS)
        self.itl = histogram("engine:inter_token_latency_seconds",
                             "Time between two steps that gave a request tokens, seconds.",
                             ITL_BUCKETS)
        self.e2e = histogram("engine:e2e_request_latency_seconds",
                             "Arrival to last token, seconds.", E2E_BUCKETS)
        token_buckets = _token_buckets(max(ctx.max_model_len, 2))
        self.request_prompt = histogram("engine:request_prompt_tokens",
                                        "Prompt tokens of finished requests.", token_buckets)
        self.request_generation = histogram("engine:request_generation_tokens",
                                            "Generated tokens of finished requests.",
                                            token_buckets)
        self.alive = gauge("engine:engine_alive", "1 while EngineCore serves, 0 once it "
                           "died or the server is shutting down.")
        self.alive.set(1)

    def record(self, scheduler_stats: SchedulerStats | None,
               iteration_stats: IterationStats | None) -> None:
        if scheduler_stats is not None:
            self.running.set(scheduler_stats.num_running_reqs)
            self.waiting.set(scheduler_stats.num_waiting_reqs)
            self.kv_usage.set(scheduler_stats.kv_cache_usage)
            self.preemptions.inc(scheduler_stats.num_preempted_reqs)
            self.prefix_queries.inc(scheduler_stats.prefix_cache.queries)
            self.prefix_hits.inc(scheduler_stats.prefix_cache.hits)
            external = scheduler_stats.connector_prefix_cache
            if external is not None:
                self.external_queries.inc(external.queries)
                self.external_hits.inc(external.hits)
        if iteration_stats is None:
            return
        self.prompt_tokens.inc(iteration_stats.num_prompt_tokens)
        self.generation_tokens.inc(iteration_stats.num_generation_tokens)
        for ttft in iteration_stats.time_to_first_tokens:
            self.ttft.observe(ttft)
        for itl in iteration_stats.inter_token_latencies:
            self.itl.observe(itl)
        for done in iteration_stats.finished_requests:
            counter = self.finished.get(done.finish_reason)
            if counter is not None:
                counter.inc()
            self.e2e.observe(done.e2e_latency)
            self.request_prompt.observe(done.num_prompt_tokens)
            self.request_generation.observe(done.num_generation_tokens)


router = APIRouter()


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text exposition of the server's registry."""
    state = server_state(request)
    engine = state.engine
    registry: CollectorRegistry = state.metrics
    try:
        await engine.get_stats()  # refreshes the gauges through the stat loggers
    except EngineDeadError:
        pass  # the gauges were zeroed at the death; /health says why
    alive = engine.dead_error is None
    for stat_logger in engine.stat_loggers.loggers.values():
        if isinstance(stat_logger, PrometheusStatLogger) and stat_logger.registry is registry:
            stat_logger.alive.set(1 if alive else 0)
            if not alive:  # also before the output handler has seen the death
                stat_logger.record(SchedulerStats(), None)
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
