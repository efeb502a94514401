"""The EngineCore side of ``offload``: which prompt blocks are stored, what to move each step.

Per request it keeps the chained hashes of the prompt's full blocks. A waiting request is
offered the longest run of leading blocks the store holds beyond its local prefix-cache
hits; once the scheduler allocated them, they are listed as loads. Every full prompt block
the store does not hold yet is listed as a save in the step that completes its KV (the
first step for prefix-cache hits, later steps for a prompt prefilled in chunks), once per
key. Only the request's prompt is stored, never generated tokens.

Which blocks the store holds: a directory store is asked (every rank's file must exist,
so blocks saved by other engines count); a CPU-memory store is this engine's own, so this
side keeps its index (least recently used first) and evicts through the metadata.
"""

from __future__ import annotations

import json
import logging
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.core.kv_cache.block_hash import extend_block_hashes
from engine.core.kv_connectors._offload_common import (
    BlockTransfer,
    OffloadMeta,
    block_file,
    bytes_per_block,
    namespace_fields,
    namespace_id,
    options_of,
    rank_dir,
)
from engine.sdk.kv_connector import KVConnectorContext, KVConnectorScheduler
from engine.sdk.scheduler import RequestStatus, RequestView, SchedulerOutput

logger = logging.getLogger("engine.kv_connector.offload")


class _DirectoryIndex:
    """Blocks in ``PATH/<namespace>/rank*/``: present when every rank's file exists."""

    def __init__(self, root: Path, namespace: str, tp_size: int) -> None:
        self.dirs = [rank_dir(root, namespace, rank) for rank in range(tp_size)]
        self._saving: set[str] = set()  # keys this engine asked to save

    def contains(self, key: str) -> bool:
        return all(block_file(d, key).is_file() for d in self.dirs)

    def needs_save(self, key: str) -> bool:
        return key not in self._saving and not self.contains(key)

    def add(self, key: str) -> list[str]:
        self._saving.add(key)
        return []

    def forget(self, key: str) -> None:
        """A save that may not have happened: let a later request save ``key`` again."""
        self._saving.discard(key)


class _MemoryIndex:
    """Keys of this engine's CPU-memory store, least recently used first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._keys: OrderedDict[str, None] = OrderedDict()

    def contains(self, key: str) -> bool:
        return key in self._keys

    def needs_save(self, key: str) -> bool:
        return key not in self._keys

    def touch(self, key: str) -> None:
        self._keys.move_to_end(key)

    def add(self, key: str) -> list[str]:
        """Record ``key``; returns the keys evicted to stay within capacity."""
        self._keys[key] = None
        evicted = []
        while len(self._keys) > self.capacity:
            evicted.append(self._keys.popitem(last=False)[0])
        return evicted

    def forget(self, key: str) -> None:
        """A save that may not have happened: the key is not offered until saved again."""
        self._keys.pop(key, None)


@dataclass
class _Tracked:
    """A request whose prompt may still have blocks to save."""

    keys: list[str]
    block_ids: list[int]
    num_decided: int  # leading prompt blocks already saved or found stored
    end: int = 0  # tokens computed by the end of the current step
    scheduled: bool = False


@dataclass
class _Step:
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    evictions: list[str] = field(default_factory=list)


class OffloadScheduler(KVConnectorScheduler):
    """See the module docstring."""

    def __init__(self, ctx: KVConnectorContext) -> None:
        super().__init__(ctx)
        options = options_of(ctx)
        self.load_async = options.load_async
        self.index: _DirectoryIndex | _MemoryIndex
        if options.path is not None:
            fields = namespace_fields(ctx, options)
            namespace = namespace_id(fields)
            root = Path(options.path).expanduser()
            (root / namespace).mkdir(parents=True, exist_ok=True)
            _write_namespace_file(root / namespace / "namespace.json", fields)
            self.index = _DirectoryIndex(root, namespace, ctx.tp_size)
            self.where = str(root / namespace)
        else:
            capacity = int(options.cpu_memory_gib * (1 << 30) // max(1, bytes_per_block(ctx)))
            self.index = _MemoryIndex(capacity)
            self.where = f"CPU memory ({capacity} blocks)"
        logger.info("offload: full prompt blocks are saved to and loaded from %s%s",
                    self.where, " (loads in the background)" if self.load_async else "")
        self._keys: dict[str, list[str]] = {}  # request id -> its prompt blocks' keys
        self._tracked: dict[str, _Tracked] = {}
        self._step = _Step()
        self._last_saves: dict[str, list[str]] = {}  # request id -> keys its last step saves
        self.num_loaded_tokens = 0  # tokens handed to the scheduler over this engine's life

    def _prompt_keys(self, request: RequestView) -> list[str]:
        keys = self._keys.get(request.request_id)
        if keys is None:
            prompt = request.prompt_token_ids
            hashes: list[bytes] = []
            extend_block_hashes(hashes, prompt, self.ctx.block_size,
                                len(prompt) // self.ctx.block_size)
            keys = self._keys[request.request_id] = [h.hex() for h in hashes]
        return keys

    def _num_stored_blocks(self, keys: Sequence[str]) -> int:
        for index, key in enumerate(keys):
            if not self.index.contains(key):
                return index
        return len(keys)

    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int, bool]:
        num_stored = self._num_stored_blocks(self._prompt_keys(request))
        num_tokens = num_stored * self.ctx.block_size - num_computed_tokens
        if num_tokens <= 0:
            return 0, False
        return num_tokens, self.load_async

    def update_state_after_alloc(
        self, request: RequestView, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        keys = self._prompt_keys(request)
        size = self.ctx.block_size
        start = request.num_computed_tokens
        first, stop = start // size, -(-(start + num_external_tokens) // size)
        for index in range(first, min(stop, len(keys), len(block_ids))):
            self._step.loads.append(BlockTransfer(
                req_id=request.request_id, block_id=block_ids[index], key=keys[index]))
            if isinstance(self.index, _MemoryIndex):
                self.index.touch(keys[index])
        if num_external_tokens:
            self.num_loaded_tokens += num_external_tokens
            logger.debug("offload: %r loads %d prompt tokens from %s", request.request_id,
                         num_external_tokens, self.where)
        # Local prefix-cache hits may be missing from the store: considered for saving too.
        self._tracked[request.request_id] = _Tracked(keys, list(block_ids), num_decided=0)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadMeta:
        out = scheduler_output
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            self._tracked.pop(req_id, None)
        counts = out.num_scheduled_tokens
        for new in out.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = list(new.block_ids)
                tracked.end, tracked.scheduled = new.num_computed_tokens + counts[new.req_id], True
        cached = out.scheduled_cached_reqs
        for req_id, block_ids, num_computed in zip(
                cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True):
            tracked = self._tracked.get(req_id)
            if tracked is not None:
                tracked.block_ids.extend(block_ids)
                tracked.end, tracked.scheduled = num_computed + counts[req_id], True
        for req_id in list(self._tracked):
            self._plan_saves(req_id, self._tracked[req_id])
        step, self._step = self._step, _Step()
        self._last_saves = {}
        for save in step.saves:
            self._last_saves.setdefault(save.req_id, []).append(save.key)
        return OffloadMeta(loads=tuple(step.loads), saves=tuple(step.saves),
                           evictions=tuple(step.evictions),
                           load_async=self.load_async and bool(step.loads))

    def _plan_saves(self, req_id: str, tracked: _Tracked) -> None:
        if not tracked.scheduled:
            return
        tracked.scheduled = False
        num_complete = min(tracked.end // self.ctx.block_size, len(tracked.keys),
                           len(tracked.block_ids))
        for index in range(tracked.num_decided, num_complete):
            key = tracked.keys[index]
            if self.index.needs_save(key):
                self._step.saves.append(BlockTransfer(
                    req_id=req_id, block_id=tracked.block_ids[index], key=key))
                self._step.evictions.extend(self.index.add(key))
        tracked.num_decided = max(tracked.num_decided, num_complete)
        if tracked.num_decided >= len(tracked.keys):
            del self._tracked[req_id]  # every prompt block is stored or on its way

    def request_finished(
        self, request: RequestView, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._keys.pop(request.request_id, None)
        self._tracked.pop(request.request_id, None)
        saves = self._last_saves.pop(request.request_id, ())
        if request.status is RequestStatus.FINISHED_ERROR:  # a plugin failed its last step:
            for key in saves:  # the blocks planned then may never have been written
                self.index.forget(key)
        return False, None


def _write_namespace_file(path: Path, fields: dict[str, Any]) -> None:
    if path.is_file():
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(fields, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
