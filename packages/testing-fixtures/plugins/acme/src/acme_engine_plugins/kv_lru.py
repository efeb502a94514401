"""``engine.kv_connectors`` entry ``acme_lru``: a bounded, in-memory prefix store of KV blocks.

Every full prompt block an engine computes is copied to host memory, keyed by the chained
hash of the prompt up to the end of that block; a later prompt with the same prefix loads
those blocks back instead of computing them (a second tier behind the engine's own prefix
cache, or the only one with ``enable_prefix_caching=False``). At most ``max_blocks`` blocks
are kept; the least recently used go first. A request's chain is refreshed from its last
block to its first, so eviction trims chains from their ends and a prefix stays usable.

The scheduler side decides everything (what to load, save and evict) and tells the workers
in each step's metadata, so the worker sides (one per tensor-parallel rank, each holding
its own heads) mirror it exactly, in any process.

A request with ``extra_args={"acme_lru_skip": True}`` is neither served from the store nor
saved to it (a prompt that must not be kept, say).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from pydantic import Field

from engine.sdk import PluginOptions, RequestStatus, SamplingParams
from engine.sdk.kv_connector import (
    KVConnector,
    KVConnectorContext,
    KVConnectorMetadata,
    KVConnectorScheduler,
    KVConnectorWorker,
)
from engine.sdk.scheduler import RequestView, SchedulerOutput

#: ``extra_args`` key: a true value keeps a request out of the store.
SKIP_KEY = "acme_lru_skip"


def skips_store(params: SamplingParams) -> bool:
    """Whether the request asked to stay out of the store (any true value)."""
    return bool((params.extra_args or {}).get(SKIP_KEY, False))


class LRUOptions(PluginOptions):
    max_blocks: int = Field(4096, ge=1, description="most KV blocks kept in host memory")


class LRUMeta(KVConnectorMetadata):
    """One step: blocks to fill before attention, blocks to copy after, keys to drop."""

    loads: dict[int, str] = Field(default_factory=dict)  # block id -> key
    saves: dict[int, str] = Field(default_factory=dict)  # block id -> key
    evict: list[str] = Field(default_factory=list)


def block_keys(token_ids: Sequence[int], block_size: int) -> list[str]:
    """One key per full block: a hash chained over the tokens up to the block's end."""
    keys, digest = [], b""
    for end in range(block_size, len(token_ids) + 1, block_size):
        data = digest + b"".join(t.to_bytes(4, "little") for t in token_ids[end - block_size:end])
        digest = hashlib.blake2b(data, digest_size=16).digest()
        keys.append(digest.hex())
    return keys


@dataclass
class _Tracked:
    """A running request's prompt keys, its block table and how far it was saved."""

    keys: list[str]
    block_ids: list[int]
    next_block: int = 0
    last_saved: list[str] = field(default_factory=list)


class LRUScheduler(KVConnectorScheduler):
    def __init__(self, ctx: KVConnectorContext) -> None:
        super().__init__(ctx)
        self.max_blocks = cast(LRUOptions, ctx.options).max_blocks
        self.lru: OrderedDict[str, None] = OrderedDict()  # keys the workers hold, oldest first
        self.tracked: dict[str, _Tracked] = {}
        self.loads: dict[int, str] = {}
        self.forgotten: list[str] = []  # keys to drop that eviction did not choose

    def get_num_new_matched_tokens(self, request: RequestView,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        if skips_store(request.sampling_params):
            return 0, False
        hits = 0
        for key in block_keys(request.prompt_token_ids, self.ctx.block_size):
            if key not in self.lru:
                break
            hits += self.ctx.block_size
        return max(0, hits - num_computed_tokens), False

    def update_state_after_alloc(self, request: RequestView, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        if skips_store(request.sampling_params):
            return  # nothing to load (0 tokens taken), nothing to save
        size = self.ctx.block_size
        keys = block_keys(request.prompt_token_ids, size)
        start = request.num_computed_tokens
        stop = start + num_external_tokens
        for index in range(start // size, min(-(-stop // size), len(keys), len(block_ids))):
            self.loads[block_ids[index]] = keys[index]  # load whole blocks
        self.tracked[request.request_id] = _Tracked(keys, list(block_ids))
        self._refresh(keys[:-(-stop // size)])  # the blocks it loads

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        ends: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self.tracked:
                self.tracked[new.req_id].block_ids = list(new.block_ids)
                ends[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_ids, computed in zip(cached.req_ids, cached.new_block_ids,
                                             cached.num_computed_tokens, strict=True):
            if req_id in self.tracked:
                self.tracked[req_id].block_ids.extend(new_ids)
                ends[req_id] = computed
        saves: dict[int, str] = {}
        for req_id, computed in ends.items():
            end = computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            saves.update(self._plan_saves(self.tracked[req_id], end))
        for req_id in scheduler_output.preempted_req_ids:
            self.tracked.pop(req_id, None)  # re-admitted later with new blocks
        evict, self.forgotten = self.forgotten, []
        while len(self.lru) > self.max_blocks:
            evict.append(self.lru.popitem(last=False)[0])
        meta = LRUMeta(loads=self.loads, saves=saves, evict=evict)
        self.loads = {}
        return meta

    def _plan_saves(self, tracked: _Tracked, end: int) -> dict[int, str]:
        """Blocks of ``tracked`` whose tokens are all computed by ``end`` and not stored."""
        saves: dict[int, str] = {}
        size = self.ctx.block_size
        while (tracked.next_block < len(tracked.keys)
               and (tracked.next_block + 1) * size <= end
               and tracked.next_block < len(tracked.block_ids)):
            key = tracked.keys[tracked.next_block]
            if key not in self.lru:
                saves[tracked.block_ids[tracked.next_block]] = key
                self.lru[key] = None
            tracked.next_block += 1
        tracked.last_saved = list(saves.values())
        if saves:
            self._refresh(tracked.keys[:tracked.next_block])
        return saves

    def _refresh(self, chain: Sequence[str]) -> None:
        """Mark ``chain``'s stored keys used, its first block the most recent."""
        for key in reversed(chain):
            if key in self.lru:
                self.lru.move_to_end(key)

    def request_finished(self, request: RequestView,
                         block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        tracked = self.tracked.pop(request.request_id, None)
        if tracked is not None and request.status == RequestStatus.FINISHED_ERROR:
            # Its last step may not have run: what it was to save may never have been written.
            for key in tracked.last_saved:
                if key in self.lru:
                    del self.lru[key]
                    self.forgotten.append(key)
        return False, None


class LRUWorker(KVConnectorWorker):
    def __init__(self, ctx: KVConnectorContext) -> None:
        super().__init__(ctx)
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.store: dict[str, dict[str, torch.Tensor]] = {}  # key -> layer -> block (host)
        self.meta = LRUMeta()
        self.pending: dict[str, dict[str, torch.Tensor]] = {}  # this step's saves
        self.evict_after_step: list[str] = []

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = kv_caches

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        self._evict(self.evict_after_step)  # left over if the last step stopped early
        self.meta = cast(LRUMeta, metadata)
        self.pending = {}
        self.evict_after_step = list(self.meta.evict)

    def wait_for_layer_load(self, layer_name: str) -> None:
        cache = self.kv_caches[layer_name]
        for block_id, key in self.meta.loads.items():
            cache[:, block_id].copy_(self.store[key][layer_name])

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: Any) -> None:
        for block_id, key in self.meta.saves.items():
            self.pending.setdefault(key, {})[layer_name] = kv_layer[:, block_id].to(
                "cpu", copy=True)

    def wait_for_save(self) -> None:
        layers = set(self.kv_caches)
        for key, blocks in self.pending.items():
            if set(blocks) == layers:  # only blocks every layer saved
                self.store[key] = blocks
        self.pending = {}
        self._evict(self.evict_after_step)

    def _evict(self, keys: list[str]) -> None:
        for key in keys:
            self.store.pop(key, None)
        keys.clear()


class LRUConnector(KVConnector):
    """``--kv-connector acme_lru``, option ``max_blocks`` (default 4096)."""

    name = "acme_lru"
    extra_args_keys = frozenset({SKIP_KEY})  # requests may send extra_args={SKIP_KEY: true}
    Options = LRUOptions
    scheduler_cls = LRUScheduler
    worker_cls = LRUWorker
    metadata_cls = LRUMeta
