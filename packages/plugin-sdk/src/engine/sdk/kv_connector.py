"""The KV-connector contract: moving KV-cache blocks to and from outside the engine.

A connector (disaggregated prefill, KV offload to host or remote storage, ...) is a pair of
classes declared by one :class:`KVConnector` entry in ``engine.kv_connectors``:

* :class:`KVConnectorScheduler` lives in EngineCore beside the scheduler: it says how many
  prompt tokens it can supply, learns which blocks they go to, and describes each step's
  transfers as :class:`KVConnectorMetadata`.
* :class:`KVConnectorWorker` lives in each worker: it moves the bytes, layer by layer,
  around the model's forward pass.

The two sides share nothing but the metadata, which crosses gRPC as bytes
(:meth:`KVConnectorMetadata.to_bytes`). Both are built from a :class:`KVConnectorContext`
after the KV cache is sized.

One step::

    EngineCore (scheduler thread)                    each worker
    ----------------------------                     -----------
    schedule():
      n, load_async = get_num_new_matched_tokens(r, num_computed)   (per waiting request)
      update_state_after_alloc(r, block_ids, n)     (after blocks are allocated)
      meta = build_connector_meta(output)           (once) --bytes-->
                                                     start_load_kv(meta)
                                                     for each attention layer:
                                                       wait_for_layer_load(layer)
                                                       <attention writes the layer's KV>
                                                       save_kv_layer(layer, kv, attn_meta)
                                                     wait_for_save()
                                                     sending, recving = get_finished(ids)
    update_from_output(): requests in ``recving`` become schedulable; blocks of requests
    in ``sending`` are freed.
    request finished: request_finished(r, block_ids) -> (free later?, params for client)

.. versionadded:: 1.0
"""

from __future__ import annotations

import enum
import inspect
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict

from engine.sdk.context import PluginContext
from engine.sdk.plugin import Plugin

if TYPE_CHECKING:
    import torch
    from typing_extensions import Self

    from engine.sdk.scheduler import RequestView, SchedulerOutput


class KVConnectorRole(enum.Enum):
    """Which side of a connector a process builds.

    .. versionadded:: 1.0
    """

    SCHEDULER = "scheduler"
    WORKER = "worker"


@dataclass(frozen=True, kw_only=True)
class KVConnectorContext(PluginContext):
    """What either side of a connector is told at construction.

    Attributes:
        role: The side being built.
        engine_id: Id of this engine (tells peers apart in disaggregated setups); the same
            on both sides and on every rank (the engine derives it from its configuration).
        block_size: Tokens per KV-cache block.
        num_blocks: Blocks in the KV cache (block 0, the null block, included).
        num_layers: Attention layers in the model.
        layer_names: The attention layers' names, in model order, on the worker side (the
            scheduler side, which never builds the model, gets an empty tuple and the head
            geometry from the model's config).
        num_kv_heads: Key/value heads per layer on one tensor-parallel rank.
        head_size: Elements per head.
        kv_cache_dtype: Dtype of the KV cache, e.g. ``"bfloat16"``.
        tp_rank: The worker's tensor-parallel rank (0 on the scheduler side).
        tp_size: Number of tensor-parallel ranks.

    .. versionadded:: 1.0
    """

    role: KVConnectorRole
    engine_id: str
    block_size: int
    num_blocks: int
    num_layers: int
    layer_names: tuple[str, ...] = ()
    num_kv_heads: int
    head_size: int
    kv_cache_dtype: str
    tp_rank: int = 0
    tp_size: int = 1


class KVConnectorMetadata(BaseModel):
    """One step's transfer instructions, from the scheduler side to every worker.

    A pydantic model: subclass it with typed fields. The default wire format is the
    model's JSON (``bytes`` fields as base64), validated again on the worker side, so a
    malformed payload fails loudly. Override both :meth:`to_bytes` and :meth:`from_bytes`
    for another format; they must be inverse.

    Example::

        class MyMeta(KVConnectorMetadata):
            loads: dict[str, list[int]] = {}    # request id -> block ids to fill

    .. versionadded:: 1.0
    """

    model_config = ConfigDict(
        frozen=True, extra="forbid", ser_json_bytes="base64", val_json_bytes="base64"
    )

    def to_bytes(self) -> bytes:
        """Serialise for the trip to the workers.

        Called: in EngineCore, once per step, on the result of ``build_connector_meta``.
        """
        return self.model_dump_json().encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Self:
        """Rebuild the metadata from :meth:`to_bytes` output.

        Called: in each worker, once per step, with the class named by
        ``KVConnector.metadata_cls``.

        Raises:
            pydantic.ValidationError: ``data`` is not this class's serialised form.
        """
        return cls.model_validate_json(data)


class KVConnectorScheduler(ABC):
    """The EngineCore side of a connector.

    Called: every method on the EngineCore thread, from inside the scheduler; never
    concurrently.

    .. versionadded:: 1.0
    """

    def __init__(self, ctx: KVConnectorContext) -> None:
        """Store the context.

        Called: once in EngineCore, after the KV cache is sized, before the first step.
        """
        self.ctx = ctx

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """How many tokens past ``num_computed_tokens`` the connector can supply.

        Called: while the scheduler considers a waiting request; possibly several times
        for the same request (each time it is reconsidered).

        Args:
            request: The waiting request.
            num_computed_tokens: Tokens already available locally (prefix-cache hits).

        Returns:
            ``(num_tokens, load_async)``: external tokens available (0 for none), and
            whether they load asynchronously (the request then waits, holding its blocks,
            until the worker reports it in ``get_finished``'s receiving set) rather than
            during the next forward pass.

        Must: be free of side effects. The scheduler may take fewer tokens than offered
        (it always computes the last prompt token itself); it passes the number taken
        to :meth:`update_state_after_alloc`.
        """
        raise NotImplementedError

    @abstractmethod
    def update_state_after_alloc(
        self, request: RequestView, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """Learn the blocks a request got, and how many external tokens to load into them.

        Called: once each time the scheduler allocates blocks for a request it asked
        :meth:`get_num_new_matched_tokens` about, in the same ``schedule()`` call.

        Args:
            request: The request.
            block_ids: All of the request's blocks, in order (prefix-cached ones first).
            num_external_tokens: Tokens to load, starting at the request's
                ``num_computed_tokens`` (0: load nothing; the call still happens).
        """
        raise NotImplementedError

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Describe this step's transfers for the workers.

        Called: once per step, at the end of ``schedule()``; the result is serialised with
        ``to_bytes`` into ``SchedulerOutput.kv_connector_metadata``.

        Must: return an instance of ``KVConnector.metadata_cls``; describe only this step
        (reset per-step state here).
        """
        raise NotImplementedError

    def request_finished(
        self, request: RequestView, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """A request finished or was aborted; decide whether its blocks stay in use.

        Called: once per request, when it finishes, before its blocks are freed.

        Returns:
            ``(free_later, kv_transfer_params)``. ``free_later`` True: the connector still
            reads the blocks; the engine frees them when a worker reports the request in
            ``get_finished``'s sending set. ``kv_transfer_params``: JSON-serialisable
            values returned to the client (``kv_transfer_params``), or ``None``.
            Default: ``(False, None)``.
        """
        return False, None

    def shutdown(self) -> None:
        """Release resources. Called once when EngineCore stops. Default: nothing."""
        return None


class KVConnectorWorker(ABC):
    """The worker side of a connector: moves KV blocks around the forward pass.

    Called: every method on the worker's main thread, in the step order shown in the
    module docstring. Transfers may run on the connector's own threads or streams.

    .. versionadded:: 1.0
    """

    def __init__(self, ctx: KVConnectorContext) -> None:
        """Store the context.

        Called: once per worker, after the KV cache is sized, before it is registered.
        """
        self.ctx = ctx

    @abstractmethod
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Receive the KV-cache tensors (e.g. to pin or register them for transfers).

        Called: once per worker, after the KV cache is allocated, before the first step.

        Args:
            kv_caches: Layer name -> that layer's cache tensor, shaped by the attention
                backend's ``get_kv_cache_shape``.
        """
        raise NotImplementedError

    @abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Start loading this step's external KV into the cache.

        Called: once per step, before the model's forward pass (also for steps with
        nothing to load).

        Args:
            metadata: The step's metadata, an instance of ``KVConnector.metadata_cls``.
        """
        raise NotImplementedError

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until ``layer_name``'s KV for this step is in place.

        Called: once per step per attention layer, just before its attention runs.
        """
        raise NotImplementedError

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        """Start saving a layer's KV after its attention wrote the step's tokens.

        Called: once per step per attention layer, right after its attention ran.

        Args:
            layer_name: The layer.
            kv_layer: The layer's cache tensor (same object as in ``register_kv_caches``).
            attn_metadata: The attention backend's metadata for the step.

        Must: not modify ``kv_layer``. May: return before the copy completes.
        """
        raise NotImplementedError

    @abstractmethod
    def wait_for_save(self) -> None:
        """Block until every save started this step may safely proceed past the step.

        Called: once per step, after the forward pass, before the step's result is sent.
        """
        raise NotImplementedError

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """Report asynchronous transfers that completed since the last call.

        Called: once per step, after ``wait_for_save``.

        Args:
            finished_req_ids: Requests that finished in the scheduler since the last call.

        Returns:
            ``(sending_done, receiving_done)``: requests whose delayed-free blocks
            (``request_finished`` returned True) may now be freed, and requests whose
            asynchronous load (``load_async`` True) completed. Default: two empty sets,
            correct only for connectors that neither load asynchronously nor delay frees.
        """
        return set(), set()

    def shutdown(self) -> None:
        """Release resources. Called once when the worker stops. Default: nothing."""
        return None


def _abstract_names(cls: type) -> set[str]:
    """Abstract methods of ``cls`` as ABCMeta will compute them (after __init_subclass__)."""
    names = {n for n, v in vars(cls).items() if getattr(v, "__isabstractmethod__", False)}
    for base in cls.__mro__[1:]:
        for n in getattr(base, "__abstractmethods__", ()):
            if getattr(getattr(cls, n, None), "__isabstractmethod__", False):
                names.add(n)
    return names


def _require_class(owner: type, attr: str, base: type) -> None:
    value = getattr(owner, attr, None)
    where = f"KVConnector {owner.__module__}:{owner.__qualname__}"
    if value is None:
        raise TypeError(f"{where} must set {attr} to a subclass of {base.__qualname__}")
    if not (isinstance(value, type) and issubclass(value, base)):
        raise TypeError(
            f"{where}: {attr} must be a subclass of {base.__qualname__}, got {value!r}"
        )
    if inspect.isabstract(value):
        missing = ", ".join(sorted(getattr(value, "__abstractmethods__", ())))
        raise TypeError(f"{where}: {attr} {value.__qualname__} leaves abstract methods: {missing}")


class KVConnector(Plugin, ABC):
    """Declares a connector's two sides; the entry in ``engine.kv_connectors``.

    Never instantiated: EngineCore builds ``scheduler_cls(ctx)``, each worker builds
    ``worker_cls(ctx)``. Checked at class creation: a subclass without abstract methods
    must set ``scheduler_cls`` and ``worker_cls`` to concrete subclasses of the two ABCs
    (``TypeError`` otherwise).

    Example::

        class MyConnector(KVConnector):
            name = "my_connector"
            scheduler_cls = MySchedulerSide
            worker_cls = MyWorkerSide
            metadata_cls = MyMeta

    Attributes:
        name: Unique connector name (``--kv-connector NAME``).
        scheduler_cls: The EngineCore side.
        worker_cls: The worker side.
        metadata_cls: The metadata class the workers decode with (default: the empty
            base class).

    .. versionadded:: 1.0
    """

    name: ClassVar[str] = ""
    scheduler_cls: ClassVar[type[KVConnectorScheduler]]
    worker_cls: ClassVar[type[KVConnectorWorker]]
    metadata_cls: ClassVar[type[KVConnectorMetadata]] = KVConnectorMetadata

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if _abstract_names(cls):
            return
        _require_class(cls, "scheduler_cls", KVConnectorScheduler)
        _require_class(cls, "worker_cls", KVConnectorWorker)
        _require_class(cls, "metadata_cls", KVConnectorMetadata)
