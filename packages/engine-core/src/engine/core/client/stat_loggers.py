"""Stat loggers in the front end: the built-in log lines, and fan-out to every logger.

``LoggingStatLogger`` writes what vLLM operators expect to read:

* one INFO line per finished request (id, prompt and generated tokens, finish reason,
  latency, time to first token);
* a throughput line every ``log()`` (every ~10 s) while the engine is busy: average prompt
  and generation tokens/s since the previous line, running and waiting requests, KV-cache
  usage and prefix-cache hit rate (and, with a KV connector, the connector's hit rate).

``StatLoggerSet`` hands each step's stats to every logger (built-ins, the server's
Prometheus logger, ``engine.stat_loggers`` plugins), under ``AsyncLLM`` and ``LLMEngine``
alike, and calls every logger's ``shutdown()`` once when the engine stops.
:func:`make_stat_loggers` builds the set both front ends use.

When EngineCore dies (:meth:`StatLoggerSet.mark_engine_dead`) every logger gets one last,
empty ``SchedulerStats`` (no request runs or waits, no KV block is held: gauges read 0,
not the figures of the step before the death), so the built-in throughput line stops (the
engine is no longer busy), and each periodic ``log()`` starts with a line that says the
engine is dead, and why.

A logger that raises never fails a request or stops the engine (the run-time fault policy
of docs/plugins/stat-loggers.md):

* the exception is caught; that call's stats are lost for that logger only, and every
  other logger still gets them;
* it is logged at ERROR with its traceback, naming the plugin, group and distribution
  (``plugin 'x' (group engine.stat_loggers, distribution d 1.0): record() raised ...``);
* the same error again (same method, exception type and message) is only counted
  (``StatLoggerSet.failures``, a DEBUG line); a different one is logged like the first;
* the logger keeps being called on later steps (a transient error may heal), and
  ``shutdown()`` ends with one WARNING per logger that failed, with its counts.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

from engine.core.messages import EngineInfo
from engine.core.plugin_construction import construct_plugin
from engine.core.plugins import PluginEntry
from engine.core.plugins._loader import plugin_error
from engine.core.startup import EngineSetup
from engine.sdk.groups import STAT_LOGGERS
from engine.sdk.plugin import PluginOptions
from engine.sdk.stat_logger import StatLogger, StatLoggerContext
from engine.sdk.stats import IterationStats, SchedulerStats

#: Builds a stat logger from its context (a ``StatLogger`` subclass fits).
StatLoggerFactory = Callable[[StatLoggerContext], StatLogger]

logger = logging.getLogger("engine.stats")


def _percent(queries: int, hits: int) -> str:
    return f"{100 * hits / queries if queries else 0.0:.1f}%"


class LoggingStatLogger(StatLogger):
    """Per-request INFO lines and a periodic throughput line (see the module docstring)."""

    def __init__(self, ctx: StatLoggerContext) -> None:
        super().__init__(ctx)
        self._last_log_time = time.monotonic()
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._queries = 0
        self._hits = 0
        #: The connector's (queries, hits); None while no stats had connector lookups.
        self._external: tuple[int, int] | None = None
        self._last_scheduler_stats = SchedulerStats()

    def record(self, scheduler_stats: SchedulerStats | None,
               iteration_stats: IterationStats | None) -> None:
        if scheduler_stats is not None:
            self._last_scheduler_stats = scheduler_stats
            self._queries += scheduler_stats.prefix_cache.queries
            self._hits += scheduler_stats.prefix_cache.hits
            external = scheduler_stats.connector_prefix_cache
            if external is not None:
                queries, hits = self._external or (0, 0)
                self._external = (queries + external.queries, hits + external.hits)
        if iteration_stats is None:
            return
        self._num_prompt_tokens += iteration_stats.num_prompt_tokens
        self._num_generation_tokens += iteration_stats.num_generation_tokens
        for done in iteration_stats.finished_requests:
            logger.info(
                "Finished request %s: prompt_tokens=%d generation_tokens=%d "
                "finish_reason=%s latency=%.3fs ttft=%.3fs", done.request_id,
                done.num_prompt_tokens, done.num_generation_tokens, done.finish_reason,
                done.e2e_latency, done.time_to_first_token)

    def log(self) -> None:
        now = time.monotonic()
        elapsed = max(now - self._last_log_time, 1e-9)
        stats = self._last_scheduler_stats
        busy = (self._num_prompt_tokens or self._num_generation_tokens
                or stats.num_running_reqs or stats.num_waiting_reqs)
        if busy:
            external = ""
            if self._external is not None:
                external = f", External prefix cache hit rate: {_percent(*self._external)}"
            logger.info(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f "
                "tokens/s, Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
                "Prefix cache hit rate: %s%s", self._num_prompt_tokens / elapsed,
                self._num_generation_tokens / elapsed, stats.num_running_reqs,
                stats.num_waiting_reqs, 100 * stats.kv_cache_usage,
                _percent(self._queries, self._hits), external)
        self._last_log_time = now
        self._num_prompt_tokens = self._num_generation_tokens = 0
        self._queries = self._hits = 0
        self._external = None

    def log_engine_initialized(self) -> None:
        ctx = self.ctx
        logger.info("Engine ready: model %s, max_model_len %d, %d KV blocks of %d tokens",
                    ctx.model, ctx.max_model_len, ctx.num_kv_blocks, ctx.block_size)


class StatLoggerSet:
    """Every stat logger of one engine, by name; errors are isolated per logger.

    Args:
        loggers: ``(name, logger)`` pairs, called in this order.
        entries: The catalog entry of each logger that is an ``engine.stat_loggers``
            plugin, by name: errors name its group and distribution.

    Attributes:
        failures: Failed calls per logger name, since the engine started.
    """

    def __init__(self, loggers: Sequence[tuple[str, StatLogger]],
                 entries: Mapping[str, PluginEntry] | None = None) -> None:
        self.loggers = dict(loggers)
        self.entries = dict(entries or {})
        self.failures: Counter[str] = Counter()
        self._failures_by_method: Counter[tuple[str, str]] = Counter()
        #: (name, method) -> (exception type, message) of the error last logged for it.
        self._last_logged: dict[tuple[str, str], tuple[str, str]] = {}
        self._shut_down = False
        #: (time.monotonic() of the death, why) once EngineCore died.
        self._death: tuple[float, str] | None = None

    def record(self, scheduler_stats: SchedulerStats | None,
               iteration_stats: IterationStats | None) -> None:
        """Hand one step's stats to every logger."""
        self._call_each("record", scheduler_stats, iteration_stats)

    def log(self) -> None:
        """Ask every logger for its periodic summary; once the engine died, say so first."""
        if self._death is not None:
            since, reason = self._death
            logger.error("Engine is dead (for %.0f s): %s. No request is served; restart "
                         "the server", time.monotonic() - since, reason)
        self._call_each("log")

    def mark_engine_dead(self, error: BaseException) -> None:
        """EngineCore died: an empty snapshot to every logger, and :meth:`log` says so."""
        if self._death is None:
            self._death = (time.monotonic(), str(error))
            self.record(SchedulerStats(), None)

    def log_engine_initialized(self) -> None:
        """Tell every logger the engine is ready."""
        self._call_each("log_engine_initialized")

    def shutdown(self) -> None:
        """Call every logger's ``shutdown()``: once per logger, later calls do nothing.

        Then one WARNING per logger that failed at any time, with its failure counts.
        """
        if self._shut_down:
            return
        self._shut_down = True
        self._call_each("shutdown")
        for name, count in self.failures.items():
            per_method = ", ".join(f"{method}() {n}" for (who, method), n
                                   in self._failures_by_method.items() if who == name)
            logger.warning("%s: %d failed call%s while the engine ran (%s)",
                           self.describe(name), count, "" if count == 1 else "s", per_method)

    def describe(self, name: str, cause: str = "") -> str:
        """How messages name logger ``name``: the plugin's identity, or the built-in's name."""
        entry = self.entries.get(name)
        if entry is None:
            return f"stat logger {name!r}" + (f": {cause}" if cause else "")
        return str(plugin_error(entry, cause)).removesuffix(": ")

    def _call_each(self, method: str, *args: object) -> None:
        for name, stat_logger in self.loggers.items():
            try:
                getattr(stat_logger, method)(*args)
            except Exception as exc:  # noqa: BLE001 - a stat logger must not fail requests
                self._report(name, method, exc)

    def _report(self, name: str, method: str, exc: Exception) -> None:
        self.failures[name] += 1
        self._failures_by_method[(name, method)] += 1
        error = (type(exc).__qualname__, str(exc))
        if self._last_logged.get((name, method)) == error:
            logger.debug("%s: %s() raised the same error again (%d failed calls so far)",
                         self.describe(name), method, self.failures[name])
            return
        self._last_logged[(name, method)] = error
        logger.error(
            "%s", self.describe(name, (
                f"{method}() raised {type(exc).__name__}: {exc}. Its stats of this call are "
                f"lost; requests and the other stat loggers are unaffected. It is still "
                f"called; until its error changes, further failures are only counted")),
            exc_info=exc)


def stat_logger_context(setup: EngineSetup, info: EngineInfo, name: str,
                        options: PluginOptions | None = None, *,
                        model_name: str | None = None) -> StatLoggerContext:
    """The context of stat logger ``name`` of the engine ``info`` describes.

    ``model_name`` is ``ctx.model``: the served model name (default: the display name).
    """
    return StatLoggerContext(
        plugin_name=name, options=options or PluginOptions(), process="frontend",
        model=model_name or setup.source.display_name, max_model_len=info.max_model_len,
        num_kv_blocks=info.num_kv_blocks, block_size=info.block_size)


def make_stat_loggers(setup: EngineSetup, info: EngineInfo, *,
                      plugin_classes: Mapping[str, type[StatLogger]],
                      factories: Mapping[str, StatLoggerFactory] | None = None,
                      log_stats: bool = False,
                      model_name: str | None = None) -> StatLoggerSet:
    """Every stat logger of one engine, built once EngineCore is up.

    Args:
        setup: The engine's setup (plugin options, catalog).
        info: What EngineCore reported (KV blocks, block size).
        plugin_classes: The ``engine.stat_loggers`` classes, loaded before EngineCore
            started (``setup.catalog.load_group(STAT_LOGGERS)``).
        factories: More loggers by name (the server's Prometheus logger).
        log_stats: Add the built-in :class:`LoggingStatLogger` as ``logging``.
        model_name: Every logger's ``ctx.model``: the served model name (default: the
            model's display name).

    Raises:
        PluginError: a plugin's options are invalid or its constructor raised, naming it.
    """
    loggers: list[tuple[str, StatLogger]] = []
    entries = {name: setup.catalog.resolve(STAT_LOGGERS, name) for name in plugin_classes}
    if log_stats:
        loggers.append(("logging", LoggingStatLogger(stat_logger_context(
            setup, info, "logging", model_name=model_name))))
    for name, factory in (factories or {}).items():
        loggers.append((name, factory(stat_logger_context(setup, info, name,
                                                          model_name=model_name))))
    for name, cls in plugin_classes.items():
        def make(options: PluginOptions, name: str = name, cls: type[StatLogger] = cls,
                 ) -> StatLogger:
            return cls(stat_logger_context(setup, info, name, options, model_name=model_name))

        loggers.append((name, construct_plugin(setup, STAT_LOGGERS, name, cls, make)))
    return StatLoggerSet(loggers, entries)
