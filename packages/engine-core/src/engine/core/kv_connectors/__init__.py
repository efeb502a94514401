"""KV connectors: building the selected one's two sides, and the built-in ``offload``."""

from engine.core.kv_connectors._construct import (
    KVGeometry,
    construct_kv_connector_side,
    engine_id_of,
    kv_connector_context,
    kv_connector_options,
    load_kv_connector,
    scheduler_geometry,
)
from engine.core.kv_connectors.offload import OffloadConnector, OffloadMeta, OffloadOptions

__all__ = [
    # construction (EngineCore and workers)
    "KVGeometry",
    "construct_kv_connector_side",
    "engine_id_of",
    "kv_connector_context",
    "kv_connector_options",
    "load_kv_connector",
    "scheduler_geometry",
    # the built-in connector
    "OffloadConnector",
    "OffloadMeta",
    "OffloadOptions",
]
