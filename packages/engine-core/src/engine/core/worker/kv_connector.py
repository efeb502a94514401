"""``WorkerKVConnector``: the worker side of the selected KV connector, around each step.

Built by the worker once its KV cache is allocated (every tensor-parallel rank builds its
own), it registers the cache tensors, binds itself to every attention layer, and gives the
model runner two calls per step::

    connector.start_step(scheduler_output)   # metadata from bytes, start_load_kv
    <forward pass: each attention layer calls wait_for_layer_load / save_kv_layer>
    sending, recving = connector.finish_step(scheduler_output)   # wait_for_save, get_finished

Both calls happen on every step, also on steps that run no forward pass (an asynchronous
load may start, or complete, while nothing is scheduled).

Under tensor parallelism a transfer is complete only when every rank has completed its
share: each rank's ``get_finished`` sets are gathered to rank 0, which reports a request
once all ranks have (skipped for connectors that keep the SDK's default ``get_finished``).
Every exception a hook raises becomes a ``PluginError`` naming the connector.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from engine.core.distributed import TensorParallelGroup
from engine.core.kv_connectors import (
    KVGeometry,
    construct_kv_connector_side,
    kv_connector_context,
    kv_connector_options,
    load_kv_connector,
)
from engine.core.plugin_faults import call_plugin
from engine.sdk.errors import PluginError
from engine.sdk.groups import KV_CONNECTORS
from engine.sdk.kv_connector import (
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorker,
)
from engine.sdk.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from engine.core.model_executor.layers import Attention
    from engine.core.startup import EngineSetup

T = TypeVar("T")


class WorkerKVConnector:
    """One rank's connector worker side, with the engine's bookkeeping around it.

    Args:
        connector: The SDK worker side (already constructed).
        metadata_cls: ``KVConnector.metadata_cls``, to decode each step's bytes with.
        tp: This rank's tensor-parallel group.
        error: Builds the ``PluginError`` naming the connector from a cause.
    """

    def __init__(self, connector: KVConnectorWorker, metadata_cls: type[KVConnectorMetadata],
                 *, tp: TensorParallelGroup, error: Callable[[str], PluginError]) -> None:
        self.connector = connector
        self.metadata_cls = metadata_cls
        self.tp = tp
        self._error = error
        self._reports_transfers = (type(connector).get_finished
                                   is not KVConnectorWorker.get_finished)
        self._num_sent: Counter[str] = Counter()  # rank 0: ranks that reported each id
        self._num_received: Counter[str] = Counter()

    @classmethod
    def build(cls, setup: EngineSetup, *, layers: dict[str, Attention],
              kv_caches: dict[str, torch.Tensor], num_blocks: int,
              tp: TensorParallelGroup) -> WorkerKVConnector | None:
        """The selected connector's worker side, registered and bound to ``layers``.

        Returns None without ``--kv-connector``.

        Raises:
            PluginError: it cannot be loaded, constructed or registered, naming it.
        """
        connector_cls = load_kv_connector(setup)
        if connector_cls is None:
            return None
        first = next(iter(layers.values()))
        geometry = KVGeometry(num_blocks=num_blocks, num_layers=len(layers),
                              num_kv_heads=first.num_kv_heads, head_size=first.head_size,
                              layer_names=tuple(layers))
        ctx = kv_connector_context(setup, KVConnectorRole.WORKER, geometry,
                                   kv_connector_options(setup, connector_cls),
                                   tp_rank=tp.rank)
        side = construct_kv_connector_side(setup, connector_cls, ctx)
        assert isinstance(side, KVConnectorWorker)
        name = ctx.plugin_name

        def error(cause: str) -> PluginError:
            return setup.catalog.error(KV_CONNECTORS, name, cause)

        runner = cls(side, connector_cls.metadata_cls, tp=tp, error=error)
        runner._call("register_kv_caches", side.register_kv_caches, dict(kv_caches))
        for layer in layers.values():
            layer.kv_connector = runner
        return runner

    def _call(self, hook: str, fn: Callable[..., T], *args: Any) -> T:
        return call_plugin(hook, fn, *args, error=self._error)

    # -- one step --------------------------------------------------------------------

    def start_step(self, out: SchedulerOutput) -> None:
        """Decode the step's metadata and call ``start_load_kv``.

        Raises:
            PluginError: no metadata (the scheduler does not drive KV connectors), bytes
                that do not decode, or ``start_load_kv`` raised.
        """
        if out.kv_connector_metadata is None:
            raise self._error(
                "the step carries no kv_connector_metadata: the selected scheduler does not "
                "drive KV connectors (use the default scheduler, or unset --kv-connector)")
        metadata = self._call(f"{self.metadata_cls.__qualname__}.from_bytes",
                              self.metadata_cls.from_bytes, out.kv_connector_metadata)
        self._call("start_load_kv", self.connector.start_load_kv, metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Called by attention layer ``layer_name`` before its attention runs."""
        self._call("wait_for_layer_load", self.connector.wait_for_layer_load, layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        """Called by attention layer ``layer_name`` after its attention wrote the KV."""
        self._call("save_kv_layer", self.connector.save_kv_layer, layer_name, kv_layer,
                   attn_metadata)

    def finish_step(self, out: SchedulerOutput) -> tuple[frozenset[str], frozenset[str]]:
        """``wait_for_save`` and ``get_finished``; rank 0 returns what every rank finished.

        Returns:
            ``(finished_sending, finished_recving)`` (empty on ranks other than 0).
        """
        self._call("wait_for_save", self.connector.wait_for_save)
        result = self._call("get_finished", self.connector.get_finished,
                            set(out.finished_req_ids))
        if (not isinstance(result, tuple) or len(result) != 2
                or not all(isinstance(ids, (set, frozenset)) for ids in result)):
            raise self._error(f"get_finished returned {result!r}; it must return two sets "
                              f"of request ids (sending_done, receiving_done)")
        sending, recving = frozenset(result[0]), frozenset(result[1])
        if not self.tp.is_parallel:
            return sending, recving
        if not self._reports_transfers:
            return frozenset(), frozenset()
        return self._all_ranks_done(sending, recving)

    def _all_ranks_done(self, sending: frozenset[str], recving: frozenset[str],
                        ) -> tuple[frozenset[str], frozenset[str]]:
        tp = self.tp
        gathered: list[Any] | None = [None] * tp.size if tp.is_driver else None
        dist.gather_object((sending, recving), gathered, dst=0, group=tp.process_group)
        if gathered is None:
            return frozenset(), frozenset()
        done: list[frozenset[str]] = []
        for index, counts in enumerate((self._num_sent, self._num_received)):
            for rank_sets in gathered:
                counts.update(rank_sets[index])
            complete = frozenset(i for i, n in counts.items() if n >= tp.size)
            for request_id in complete:
                del counts[request_id]
            done.append(complete)
        return done[0], done[1]

    def shutdown(self) -> None:
        """The connector's ``shutdown`` (errors propagate to the worker, which logs them)."""
        self._call("shutdown", self.connector.shutdown)
