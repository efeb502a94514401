"""The KV-connector contract: class checks, metadata wire format, and an offload connector."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pydantic
import pytest
import torch

from engine.sdk._version import __version__
from engine.sdk.context import PluginContext
from engine.sdk.kv_connector import (
    KVConnector,
    KVConnectorContext,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorScheduler,
    KVConnectorWorker,
)
from engine.sdk.sampling_params import SamplingParams
from engine.sdk.scheduler import CachedRequestData, RequestStatus, RequestView, SchedulerOutput

BLOCK = 4
LAYERS = ("layer.0", "layer.1")


@dataclass(frozen=True)
class FakeRequest:
    """Satisfies RequestView (the engine's own request objects do too)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...] = ()
    num_computed_tokens: int = 0
    sampling_params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    priority: int = 0
    arrival_time: float = 0.0
    status: RequestStatus = RequestStatus.WAITING

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


def empty_output() -> SchedulerOutput:
    return SchedulerOutput(scheduled_new_reqs=(), scheduled_cached_reqs=CachedRequestData(),
                           num_scheduled_tokens={}, total_num_scheduled_tokens=0)


def make_ctx(role: KVConnectorRole) -> KVConnectorContext:
    return KVConnectorContext(role=role, engine_id="e0", block_size=BLOCK, num_blocks=8,
                              num_layers=len(LAYERS), layer_names=LAYERS, num_kv_heads=2,
                              head_size=4, kv_cache_dtype="float32")


# --- an in-memory prefix offload connector, written from the SDK docstrings ------------------

#: The "external storage": full-block token prefix -> layer name -> [2, BLOCK, heads, dim].
STORE: dict[tuple[int, ...], dict[str, torch.Tensor]] = {}


class BlockCopy(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(frozen=True)
    prefix: tuple[int, ...]
    block_id: int


class OffloadMeta(KVConnectorMetadata):
    loads: tuple[BlockCopy, ...] = ()
    saves: tuple[BlockCopy, ...] = ()


def _prefixes(tokens: Sequence[int], start: int, stop: int) -> list[tuple[int, ...]]:
    return [tuple(tokens[: end + BLOCK]) for end in range(start, stop, BLOCK)]


class OffloadScheduler(KVConnectorScheduler):
    def __init__(self, ctx: KVConnectorContext) -> None:
        super().__init__(ctx)
        self.loads: list[BlockCopy] = []
        self.saves: list[BlockCopy] = []

    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int, bool]:
        full = len(request.prompt_token_ids) // BLOCK * BLOCK
        hits = 0
        for prefix in _prefixes(request.prompt_token_ids, 0, full):
            if prefix not in STORE:
                break
            hits += BLOCK
        return max(0, hits - num_computed_tokens), False

    def update_state_after_alloc(
        self, request: RequestView, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        tokens, start = request.prompt_token_ids, request.num_computed_tokens
        stop = start + num_external_tokens
        def copy(prefix: tuple[int, ...]) -> BlockCopy:
            return BlockCopy(prefix=prefix, block_id=block_ids[len(prefix) // BLOCK - 1])

        self.loads += [copy(p) for p in _prefixes(tokens, start, stop)]
        self.saves += [copy(p) for p in _prefixes(tokens, stop, len(tokens) // BLOCK * BLOCK)]

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = OffloadMeta(loads=tuple(self.loads), saves=tuple(self.saves))
        self.loads, self.saves = [], []
        return meta

    def request_finished(
        self, request: RequestView, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, {"stored_blocks": len(block_ids)}


class OffloadWorker(KVConnectorWorker):
    def __init__(self, ctx: KVConnectorContext) -> None:
        super().__init__(ctx)
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.meta = OffloadMeta()
        self.calls: list[str] = []

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = kv_caches

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        assert isinstance(metadata, OffloadMeta)
        self.meta = metadata
        for copy in metadata.loads:
            for layer, cache in self.kv_caches.items():
                cache[:, copy.block_id] = STORE[copy.prefix][layer]

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.calls.append(f"wait:{layer_name}")

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        for copy in self.meta.saves:
            STORE.setdefault(copy.prefix, {})[layer_name] = kv_layer[:, copy.block_id].clone()

    def wait_for_save(self) -> None:
        self.calls.append("wait_for_save")


class OffloadConnector(KVConnector):
    name = "test_offload"
    scheduler_cls = OffloadScheduler
    worker_cls = OffloadWorker
    metadata_cls = OffloadMeta


def run_worker_step(worker: OffloadWorker, payload: bytes, write: dict[int, float]) -> None:
    """What a worker does around one forward pass; ``write`` fakes attention's KV writes."""
    worker.start_load_kv(OffloadConnector.metadata_cls.from_bytes(payload))
    for layer in LAYERS:
        worker.wait_for_layer_load(layer)
        for block_id, fill in write.items():
            worker.kv_caches[layer][:, block_id] = fill + LAYERS.index(layer)
        worker.save_kv_layer(layer, worker.kv_caches[layer], attn_metadata=None)
    worker.wait_for_save()
    assert worker.get_finished(set()) == (set(), set())


def test_offloaded_prefix_is_loaded_into_another_requests_blocks() -> None:
    STORE.clear()
    sched = OffloadConnector.scheduler_cls(make_ctx(KVConnectorRole.SCHEDULER))
    worker = OffloadConnector.worker_cls(make_ctx(KVConnectorRole.WORKER))
    assert isinstance(worker, OffloadWorker)
    shape = (2, 8, BLOCK, 2, 4)
    worker.register_kv_caches({layer: torch.zeros(shape) for layer in LAYERS})

    a = FakeRequest("a", tuple(range(8)))
    assert sched.get_num_new_matched_tokens(a, 0) == (0, False)
    sched.update_state_after_alloc(a, [1, 2], 0)
    run_worker_step(worker, sched.build_connector_meta(empty_output()).to_bytes(),
                    write={1: 10.0, 2: 20.0})
    assert len(STORE) == 2
    assert sched.request_finished(a, [1, 2]) == (False, {"stored_blocks": 2})

    b = FakeRequest("b", (*range(8), 99, 98))
    # Side-effect free: asking twice gives the same answer and schedules nothing.
    assert sched.get_num_new_matched_tokens(b, 0) == (8, False)
    assert sched.get_num_new_matched_tokens(b, 4) == (4, False)
    assert sched.get_num_new_matched_tokens(b, 0) == (8, False)
    assert sched.build_connector_meta(empty_output()) == OffloadMeta()
    sched.update_state_after_alloc(b, [5, 6, 7], 8)
    meta = sched.build_connector_meta(empty_output())
    assert isinstance(meta, OffloadMeta) and [c.block_id for c in meta.loads] == [5, 6]
    run_worker_step(worker, meta.to_bytes(), write={})
    for layer in LAYERS:
        cache = worker.kv_caches[layer]
        torch.testing.assert_close(cache[:, 5], cache[:, 1])
        torch.testing.assert_close(cache[:, 6], cache[:, 2])
    assert worker.calls[:3] == ["wait:layer.0", "wait:layer.1", "wait_for_save"]


# --- metadata wire format -----------------------------------------------------------------


def test_metadata_round_trips_through_bytes() -> None:
    meta = OffloadMeta(loads=(BlockCopy(prefix=(1, 2, 3, 4), block_id=3),))
    data = meta.to_bytes()
    assert isinstance(data, bytes)
    assert OffloadMeta.from_bytes(data) == meta
    assert KVConnectorMetadata.from_bytes(KVConnectorMetadata().to_bytes()) == KVConnectorMetadata()


def test_metadata_carries_binary_payloads_as_base64() -> None:
    class BlobMeta(KVConnectorMetadata):
        payload: bytes

    meta = BlobMeta(payload=bytes(range(256)))
    assert BlobMeta.from_bytes(meta.to_bytes()).payload == bytes(range(256))


def test_metadata_is_frozen_strict_and_fails_loudly_on_bad_input() -> None:
    meta = OffloadMeta()
    with pytest.raises(pydantic.ValidationError):
        meta.loads = ()
    with pytest.raises(pydantic.ValidationError):
        OffloadMeta(unknown=1)  # type: ignore[call-arg]
    with pytest.raises(pydantic.ValidationError):
        OffloadMeta.from_bytes(b'{"loads": "nope"}')
    with pytest.raises(pydantic.ValidationError):
        OffloadMeta.from_bytes(b"\x00not json")


# --- class-creation checks ------------------------------------------------------------------


def test_connector_must_declare_both_sides() -> None:
    with pytest.raises(TypeError, match="must set worker_cls to a subclass of KVConnectorWorker"):

        class OnlyScheduler(KVConnector):
            scheduler_cls = OffloadScheduler


def test_connector_sides_must_have_the_right_base() -> None:
    with pytest.raises(TypeError, match="scheduler_cls must be a subclass of KVConnectorSched"):

        class Swapped(KVConnector):
            scheduler_cls = OffloadWorker  # type: ignore[assignment]
            worker_cls = OffloadWorker

    with pytest.raises(TypeError, match="metadata_cls must be a subclass of KVConnectorMetadata"):

        class BadMeta(KVConnector):
            scheduler_cls = OffloadScheduler
            worker_cls = OffloadWorker
            metadata_cls = dict  # type: ignore[assignment]


def test_connector_sides_must_be_concrete() -> None:
    class LazyWorker(KVConnectorWorker):
        def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
            pass

    with pytest.raises(TypeError, match="LazyWorker leaves abstract methods: save_kv_layer, "
                                        "start_load_kv, wait_for_layer_load, wait_for_save"):

        class Lazy(KVConnector):
            scheduler_cls = OffloadScheduler
            worker_cls = LazyWorker
    with pytest.raises(TypeError, match="abstract"):
        LazyWorker(make_ctx(KVConnectorRole.WORKER))  # type: ignore[abstract]


def test_abstract_intermediate_connector_is_not_checked() -> None:
    from abc import abstractmethod

    class FamilyBase(KVConnector):
        @classmethod
        @abstractmethod
        def transport(cls) -> str: ...

    class Member(FamilyBase):
        scheduler_cls = OffloadScheduler
        worker_cls = OffloadWorker

        @classmethod
        def transport(cls) -> str:
            return "tcp"

    assert Member.transport() == "tcp"
    assert Member.sdk_version == __version__
    with pytest.raises(TypeError, match="must set scheduler_cls"):

        class Forgot(FamilyBase):
            @classmethod
            def transport(cls) -> str:
                return "tcp"


def test_context_and_defaults() -> None:
    ctx = make_ctx(KVConnectorRole.SCHEDULER)
    assert isinstance(ctx, PluginContext) and ctx.role.value == "scheduler"
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.block_size = 8  # type: ignore[misc]

    class Minimal(KVConnectorScheduler):
        def get_num_new_matched_tokens(
            self, request: RequestView, num_computed_tokens: int
        ) -> tuple[int, bool]:
            return 0, False

        def update_state_after_alloc(
            self, request: RequestView, block_ids: Sequence[int], num_external_tokens: int
        ) -> None:
            pass

        def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
            return KVConnectorMetadata()

    side = Minimal(ctx)
    assert side.request_finished(FakeRequest("r", (1,)), [1]) == (False, None)
    side.shutdown()
    assert isinstance(FakeRequest("r", (1,)), RequestView)
    assert OffloadConnector.sdk_version == __version__
