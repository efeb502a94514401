"""KV-connector plugin: a prefix store for full prompt blocks.

The worker side saves every full prompt block it is told to, keyed by a hash chained over
the tokens up to the end of that block; the scheduler side remembers which keys it had
saved, offers them back to later requests with the same prefix, and tells the workers
which stored blocks to load into which block ids. The two sides share nothing but the
step's :class:`Sdk1StoreMeta`, which crosses the process boundary as bytes (the SDK's
default: JSON, with the ``bytes`` keys as base64).

Loads are synchronous (done in ``start_load_kv``) and frees are never delayed, so the
default ``get_finished`` (two empty sets) is right. The store lives in the worker side's
memory: it lasts as long as the engine.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar

import torch
from pydantic import Field

from engine.sdk import (
    KVConnector,
    KVConnectorContext,
    KVConnectorMetadata,
    KVConnectorScheduler,
    KVConnectorWorker,
    RequestView,
    SchedulerOutput,
)
from engine_test_plugin_sdk1.counters import count

#: A block id in the KV cache: never the null block 0.
BlockId = Annotated[int, Field(ge=1)]


class Sdk1StoreMeta(KVConnectorMetadata):
    """One step's transfers: block id -> the key of the stored block it holds."""

    step: int = 0
    loads: dict[BlockId, bytes] = Field(default_factory=dict)  # store -> cache, before forward
    saves: dict[BlockId, bytes] = Field(default_factory=dict)  # cache -> store, per layer


def block_keys(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The chained key of every full block of ``token_ids``, in order."""
    keys: list[bytes] = []
    parent = b""
    for end in range(block_size, len(token_ids) + 1, block_size):
        digest = hashlib.sha256(parent)
        digest.update(b",".join(str(t).encode() for t in token_ids[end - block_size:end]))
        parent = digest.digest()
        keys.append(parent)
    return keys


class Sdk1StoreScheduler(KVConnectorScheduler):
    def __init__(self, ctx: KVConnectorContext) -> None:
        super().__init__(ctx)
        self.saved_keys: set[bytes] = set()
        self.step = 0
        self.loads: dict[int, bytes] = {}
        # request id -> (token end of the block, block id, key): saved once computed
        self.pending_saves: dict[str, list[tuple[int, int, bytes]]] = {}

    def _num_stored_blocks(self, request: RequestView) -> int:
        hits = 0
        for key in block_keys(request.prompt_token_ids, self.ctx.block_size):
            if key not in self.saved_keys:
                break
            hits += 1
        return hits

    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int, bool]:
        count("sdk1_store.get_num_new_matched_tokens")
        hits = self._num_stored_blocks(request) * self.ctx.block_size
        return max(0, hits - num_computed_tokens), False

    def update_state_after_alloc(
        self, request: RequestView, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        count("sdk1_store.update_state_after_alloc")
        size = self.ctx.block_size
        start = request.num_computed_tokens
        stop = start + num_external_tokens
        saves = self.pending_saves.setdefault(request.request_id, [])
        for index, key in enumerate(block_keys(request.prompt_token_ids, size)):
            if index >= len(block_ids):
                break  # not allocated yet (a prompt prefilled in chunks)
            first, end = index * size, (index + 1) * size
            if first < stop and end > start:  # overlaps the tokens to load
                self.loads[block_ids[index]] = key
            elif first >= stop and key not in self.saved_keys:
                saves.append((end, block_ids[index], key))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        count("sdk1_store.build_connector_meta")
        self.step += 1
        computed_end = {new.req_id: new.num_computed_tokens for new in
                        scheduler_output.scheduled_new_reqs}
        saves: dict[int, bytes] = {}
        for req_id, pending in self.pending_saves.items():
            # Blocks whose tokens are all computed by the end of this step; the others of a
            # chunked prompt are not stored (their KV is not there yet).
            end = computed_end.get(req_id, 0) + scheduler_output.num_scheduled_tokens.get(
                req_id, 0)
            saves.update({block_id: key for block_end, block_id, key in pending
                          if block_end <= end and key not in self.saved_keys})
        meta = Sdk1StoreMeta(step=self.step, loads=self.loads, saves=saves)
        self.saved_keys.update(saves.values())
        self.loads, self.pending_saves = {}, {}
        return meta

    def request_finished(
        self, request: RequestView, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        count("sdk1_store.request_finished")
        stored = self._num_stored_blocks(request)
        return False, {"sdk1_stored_blocks": stored, "engine_id": self.ctx.engine_id}


class Sdk1StoreWorker(KVConnectorWorker):
    def __init__(self, ctx: KVConnectorContext) -> None:
        super().__init__(ctx)
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.store: dict[bytes, dict[str, torch.Tensor]] = {}  # key -> layer -> block
        self.meta = Sdk1StoreMeta()
        self.steps_seen: list[int] = []

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        count("sdk1_store.register_kv_caches")
        missing = [name for name in self.ctx.layer_names if name not in kv_caches]
        if missing:
            raise ValueError(f"sdk1_store: no KV cache for layers {missing}")
        self.kv_caches = dict(kv_caches)

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        count("sdk1_store.start_load_kv")
        if not isinstance(metadata, Sdk1StoreMeta):
            raise TypeError(f"sdk1_store: expected Sdk1StoreMeta, got {type(metadata).__name__}")
        self.meta = metadata
        self.steps_seen.append(metadata.step)
        for block_id, key in metadata.loads.items():
            stored = self.store.get(key)
            if stored is None:
                raise KeyError(f"sdk1_store: block {key.hex()[:12]} was never saved")
            for layer, cache in self.kv_caches.items():
                cache[:, block_id].copy_(stored[layer])  # (2, num_blocks, ...) layout

    def wait_for_layer_load(self, layer_name: str) -> None:
        count("sdk1_store.wait_for_layer_load")  # loads finished in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        count("sdk1_store.save_kv_layer")
        for block_id, key in self.meta.saves.items():
            self.store.setdefault(key, {})[layer_name] = kv_layer[:, block_id].clone()

    def wait_for_save(self) -> None:
        count("sdk1_store.wait_for_save")  # the copies above are synchronous


class Sdk1StoreConnector(KVConnector):
    """Assumes the block index is dimension 1 of each layer's cache (built-in layouts)."""

    name: ClassVar[str] = "sdk1_store"
    scheduler_cls = Sdk1StoreScheduler
    worker_cls = Sdk1StoreWorker
    metadata_cls = Sdk1StoreMeta
