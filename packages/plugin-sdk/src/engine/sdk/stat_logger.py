"""``StatLogger``: receive the engine's stats in the front end (metrics exporters, dashboards).

.. versionadded:: 1.0
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from engine.sdk.context import PluginContext
from engine.sdk.plugin import Plugin
from engine.sdk.stats import IterationStats, SchedulerStats


@dataclass(frozen=True, kw_only=True)
class StatLoggerContext(PluginContext):
    """What a stat logger is told at construction.

    Attributes:
        engine_index: Index of the engine (data-parallel replicas), 0 for one engine.
        max_model_len: Longest sequence the engine serves.
        num_kv_blocks: KV blocks in the pool.
        block_size: Tokens per KV block.

    .. versionadded:: 1.0
    """

    engine_index: int = 0
    max_model_len: int = 0
    num_kv_blocks: int = 0
    block_size: int = 0


class StatLogger(Plugin, ABC):
    """Receives stats after every engine step, in the front-end process.

    Every loaded stat logger is used (``engine.stat_loggers``), under ``engine serve``,
    ``AsyncLLM`` and the offline ``LLM`` alike. An exception in any of its methods is
    logged with the plugin's name and does not fail requests.

    .. versionadded:: 1.0
    """

    def __init__(self, ctx: StatLoggerContext) -> None:
        self.ctx = ctx

    @abstractmethod
    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None:
        """Take the stats of one step.

        Called: in the front end, on its event loop, once per batch of engine outputs.
        Must: return quickly (no I/O that blocks); buffer and export elsewhere.
        """

    def log(self) -> None:
        """Emit a periodic summary. Called: every few seconds by the front end. Default: no-op."""

    def log_engine_initialized(self) -> None:
        """Called once, when the engine is ready to serve. Default: no-op."""

    def shutdown(self) -> None:
        """Flush and release what the logger holds: the engine is stopping.

        Called: once per logger, in the front end, when the engine stops (``LLM.shutdown()``
        or the ``with`` block's end, garbage collection or interpreter exit of an ``LLM``;
        ``AsyncLLM.shutdown()``, so also when ``engine serve`` exits), after the last
        :meth:`record`. Not called for a logger whose engine never finished starting.
        Must: return within a few seconds (send buffered data, close sockets and files);
        an exception is logged with the plugin's name and does not stop the shutdown.
        Default: no-op.

        .. versionadded:: 1.1
        """
