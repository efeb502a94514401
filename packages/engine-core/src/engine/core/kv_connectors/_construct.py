"""Building the two sides of the selected KV connector (``--kv-connector NAME``).

EngineCore builds the scheduler side after the executor has sized the KV cache, every
worker builds the worker side right after it allocated its cache; both from the same
``EngineConfig``, so they agree on everything in the context but ``role`` and the rank::

    cls = load_kv_connector(setup)                       # None without --kv-connector
    options = kv_connector_options(setup, cls)            # validated against cls.Options
    ctx = kv_connector_context(setup, cls, KVConnectorRole.WORKER, geometry, options)
    side = construct_kv_connector_side(setup, cls, ctx)   # PluginError naming it on failure

Options come from ``--kv-connector-option KEY=VALUE`` (``EngineConfig.kv_connector_options``)
over any ``--plugin-option kv_connectors:NAME.KEY=VALUE``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from engine.core.plugin_options import validated_options
from engine.core.startup import EngineSetup
from engine.sdk.groups import KV_CONNECTORS
from engine.sdk.kv_connector import (
    KVConnector,
    KVConnectorContext,
    KVConnectorRole,
    KVConnectorScheduler,
    KVConnectorWorker,
)
from engine.sdk.plugin import PluginOptions


@dataclass(frozen=True)
class KVGeometry:
    """The KV cache as one side of a connector describes it.

    Attributes:
        num_blocks: Blocks in each layer's cache (the null block included).
        num_layers: Attention layers.
        layer_names: Their names, in model order (empty on the scheduler side, which
            never builds the model).
        num_kv_heads: Key/value heads per layer on one rank.
        head_size: Elements per head.
    """

    num_blocks: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    layer_names: tuple[str, ...] = ()


def load_kv_connector(setup: EngineSetup) -> type[KVConnector] | None:
    """The selected connector class (imported and checked), or None when none is selected.

    Raises:
        PluginError: unknown name, not allowed, not a ``KVConnector``, or fails to import.
    """
    name = setup.config.kv_connector
    if name is None:
        return None
    cls: type[KVConnector] = setup.catalog.load(KV_CONNECTORS, name)
    return cls


def kv_connector_options(setup: EngineSetup, cls: type[KVConnector]) -> PluginOptions:
    """The connector's options, validated against ``cls.Options``.

    Raises:
        PluginError: an option is unknown or invalid, naming the connector.
    """
    config = setup.config
    return validated_options(
        setup.catalog, KV_CONNECTORS, config.kv_connector or cls.name, cls,
        config.plugin_options,
        flag_values=("--kv-connector-option", config.kv_connector_options))


def engine_id_of(setup: EngineSetup) -> str:
    """The ``engine_id`` both sides of a connector get: derived from the engine's config.

    EngineCore and its workers (possibly other processes) compute the same value from the
    same ``EngineConfig``; engines with different configurations get different ids.
    """
    digest = hashlib.sha256(setup.config.model_dump_json().encode()).hexdigest()
    return f"engine-{digest[:16]}"


def scheduler_geometry(setup: EngineSetup, num_blocks: int) -> KVGeometry:
    """What EngineCore knows of the KV cache without the model: from the model's config."""
    hf = setup.hf_config
    num_heads = int(hf.num_attention_heads)
    num_kv_heads = int(getattr(hf, "num_key_value_heads", None) or num_heads)
    head_size = int(getattr(hf, "head_dim", None) or hf.hidden_size // num_heads)
    tp_size = setup.config.tensor_parallel_size
    return KVGeometry(num_blocks=num_blocks, num_layers=int(hf.num_hidden_layers),
                      num_kv_heads=max(1, num_kv_heads // tp_size), head_size=head_size)


def kv_connector_context(setup: EngineSetup, role: KVConnectorRole, geometry: KVGeometry,
                         options: PluginOptions, *, tp_rank: int = 0) -> KVConnectorContext:
    """The context of one side (``tp_rank`` 0 on the scheduler side)."""
    config = setup.config
    return KVConnectorContext(
        plugin_name=config.kv_connector or "", options=options,
        process="engine_core" if role is KVConnectorRole.SCHEDULER else "worker",
        model=setup.source.display_name, role=role, engine_id=engine_id_of(setup),
        block_size=setup.block_size, num_blocks=geometry.num_blocks,
        num_layers=geometry.num_layers, layer_names=geometry.layer_names,
        num_kv_heads=geometry.num_kv_heads, head_size=geometry.head_size,
        kv_cache_dtype=str(setup.dtype).removeprefix("torch."), tp_rank=tp_rank,
        tp_size=config.tensor_parallel_size,
    )


def construct_kv_connector_side(setup: EngineSetup, cls: type[KVConnector],
                                ctx: KVConnectorContext,
                                ) -> KVConnectorScheduler | KVConnectorWorker:
    """``cls.scheduler_cls(ctx)`` or ``cls.worker_cls(ctx)``, by ``ctx.role``.

    Raises:
        PluginError: the constructor raised, naming the connector and its distribution.
    """
    side = cls.scheduler_cls if ctx.role is KVConnectorRole.SCHEDULER else cls.worker_cls
    try:
        return side(ctx)
    except Exception as exc:
        raise setup.catalog.error(
            KV_CONNECTORS, ctx.plugin_name,
            f"constructing its {ctx.role.value} side {side.__qualname__} failed: "
            f"{type(exc).__name__}: {exc}") from exc
