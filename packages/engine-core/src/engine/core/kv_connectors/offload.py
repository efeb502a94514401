"""``offload``: the built-in KV connector that saves prompt blocks and loads them back.

Every full prompt block an engine computes is saved under the chained hash of the prompt
up to its end; a later request whose prompt starts the same way loads those blocks instead
of computing them, reported as cached prompt tokens (``num_cached_tokens``). With
``path`` the blocks go to files in a directory, so an engine started later on the same
directory (another process, another day) starts with them; without it they stay in this
engine's CPU memory, a second tier behind the KV cache's own prefix cache::

    engine serve MODEL --kv-connector offload --kv-connector-option path=/var/cache/kv

Options (:class:`OffloadOptions`): ``path``, ``cpu_memory_gib``, ``load_async``,
``namespace``. It uses only the SDK's connector contract, as a third-party connector would
(the scheduler side in ``_offload_scheduler``, the worker side in ``_offload_worker``).
"""

from __future__ import annotations

from typing import ClassVar

from engine.core.kv_connectors._offload_common import OffloadMeta, OffloadOptions
from engine.core.kv_connectors._offload_scheduler import OffloadScheduler
from engine.core.kv_connectors._offload_worker import OffloadWorker
from engine.sdk.kv_connector import KVConnector
from engine.sdk.plugin import PluginOptions


class OffloadConnector(KVConnector):
    """Saves full prompt blocks to a directory or CPU memory; loads them for later prompts."""

    name: ClassVar[str] = "offload"
    Options: ClassVar[type[PluginOptions]] = OffloadOptions
    scheduler_cls = OffloadScheduler
    worker_cls = OffloadWorker
    metadata_cls = OffloadMeta


__all__ = ["OffloadConnector", "OffloadMeta", "OffloadOptions", "OffloadScheduler",
           "OffloadWorker"]
