"""``test_recorder``: a KV connector that records every hook it gets, and keeps a prefix store.

Reached: every hook adds to ``CALLS`` (this process) and, with the option ``events=PATH``,
appends ``<side> <hook> rank=<tp_rank>`` to that file (seen from any process). Observable:
the worker side stores every full prompt block the scheduler side asks it to, keyed by the
prompt up to the end of the block, and loads it back for later prompts with that prefix,
so ``num_cached_tokens`` counts them. Options exercise the engine's connector paths:

* ``load_async``: loads are reported through ``get_finished`` (the request waits for it);
* ``delay_free``: ``request_finished`` keeps the blocks until ``get_finished`` reports the
  request as sent (the step after it finished);
* ``fail_in=HOOK``: that hook raises ``RuntimeError("test_recorder failed in HOOK")``;
  with ``fail_times=N`` only its first N calls in each process do (0: every call).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from pydantic import Field

from engine.sdk import (
    KVConnector,
    KVConnectorContext,
    KVConnectorMetadata,
    KVConnectorScheduler,
    KVConnectorWorker,
    PluginOptions,
    RequestStatus,
    RequestView,
    SchedulerOutput,
)

#: ``"<side>.<hook>"`` -> calls in this process.
CALLS: Counter[str] = Counter()
#: Calls of ``fail_in`` so far, per hook (cleared when a connector side is built).
FAILED: Counter[str] = Counter()


class RecorderOptions(PluginOptions):
    events: str | None = Field(None, description="file to append hook events to")
    load_async: bool = Field(False, description="report loads through get_finished")
    delay_free: bool = Field(False, description="hold finished requests' blocks a step")
    fail_in: str | None = Field(None, description="a hook that raises")
    fail_times: int = Field(0, ge=0, description="how many calls of fail_in raise (0: all)")


class RecorderMeta(KVConnectorMetadata):
    loads: dict[str, list[tuple[int, str]]] = Field(default_factory=dict)  # req -> (block, key)
    saves: list[tuple[int, str]] = Field(default_factory=list)  # (block id, key)


def _record(ctx: KVConnectorContext, side: str, hook: str) -> None:
    CALLS[f"{side}.{hook}"] += 1
    options = ctx.options
    assert isinstance(options, RecorderOptions)
    if options.events is not None:
        with open(options.events, "a") as file:
            file.write(f"{side} {hook} rank={ctx.tp_rank} pid={os.getpid()}\n")
    if options.fail_in == hook:
        FAILED[hook] += 1
        if not options.fail_times or FAILED[hook] <= options.fail_times:
            raise RuntimeError(f"test_recorder failed in {hook}")


def _keys(tokens: Sequence[int], block_size: int) -> list[str]:
    return [",".join(map(str, tokens[:end]))
            for end in range(block_size, len(tokens) + 1, block_size)]


class RecorderScheduler(KVConnectorScheduler):
    def __init__(self, ctx: KVConnectorContext) -> None:
        super().__init__(ctx)
        FAILED.clear()
        _record(ctx, "scheduler", "__init__")
        self.saved: set[str] = set()
        self.loads: dict[str, list[tuple[int, str]]] = {}
        self.pending: dict[str, list[tuple[int, int, str]]] = {}  # req -> (end, block, key)
        self.last_saves: dict[str, list[str]] = {}  # the keys the last step saves, per req

    def get_num_new_matched_tokens(self, request: RequestView,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        _record(self.ctx, "scheduler", "get_num_new_matched_tokens")
        hits = 0
        for key in _keys(request.prompt_token_ids, self.ctx.block_size):
            if key not in self.saved:
                break
            hits += self.ctx.block_size
        num_tokens = max(0, hits - num_computed_tokens)
        assert isinstance(self.ctx.options, RecorderOptions)
        return num_tokens, self.ctx.options.load_async and num_tokens > 0

    def update_state_after_alloc(self, request: RequestView, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        _record(self.ctx, "scheduler", "update_state_after_alloc")
        size = self.ctx.block_size
        start, stop = request.num_computed_tokens, request.num_computed_tokens + num_external_tokens
        for index, key in enumerate(_keys(request.prompt_token_ids, size)):
            if index >= len(block_ids):
                break
            first, end = index * size, (index + 1) * size
            if first < stop and end > start:
                self.loads.setdefault(request.request_id, []).append((block_ids[index], key))
            elif first >= stop and key not in self.saved:
                self.pending.setdefault(request.request_id, []).append(
                    (end, block_ids[index], key))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> RecorderMeta:
        _record(self.ctx, "scheduler", "build_connector_meta")
        computed = {new.req_id: new.num_computed_tokens
                    for new in scheduler_output.scheduled_new_reqs}
        saves = []
        self.last_saves = {}
        for req_id, pending in self.pending.items():
            if req_id not in computed:
                continue  # an asynchronous load: saved when it runs
            end = computed[req_id] + scheduler_output.num_scheduled_tokens[req_id]
            mine = [(block, key) for block_end, block, key in pending
                    if block_end <= end and key not in self.saved]
            self.last_saves[req_id] = [key for _, key in mine]
            saves += mine
        self.saved.update(key for _, key in saves)
        self.pending = {r: p for r, p in self.pending.items() if r not in computed}
        meta = RecorderMeta(loads=self.loads, saves=saves)
        self.loads = {}
        return meta

    def request_finished(self, request: RequestView,
                         block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        _record(self.ctx, "scheduler", "request_finished")
        self.pending.pop(request.request_id, None)
        if request.status is RequestStatus.FINISHED_ERROR:  # its last step's saves may be lost
            self.saved.difference_update(self.last_saves.pop(request.request_id, ()))
        assert isinstance(self.ctx.options, RecorderOptions)
        return self.ctx.options.delay_free, {"test_recorder": True}

    def shutdown(self) -> None:
        _record(self.ctx, "scheduler", "shutdown")


class RecorderWorker(KVConnectorWorker):
    def __init__(self, ctx: KVConnectorContext) -> None:
        super().__init__(ctx)
        FAILED.clear()
        _record(ctx, "worker", "__init__")
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.store: dict[str, dict[str, torch.Tensor]] = {}
        self.meta = RecorderMeta()
        self.received: set[str] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        _record(self.ctx, "worker", "register_kv_caches")
        self.kv_caches = kv_caches

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        _record(self.ctx, "worker", "start_load_kv")
        assert isinstance(metadata, RecorderMeta)
        self.meta = metadata
        for req_id, loads in metadata.loads.items():
            for block_id, key in loads:
                for layer, cache in self.kv_caches.items():
                    cache[:, block_id].copy_(self.store[key][layer])
            self.received.add(req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        _record(self.ctx, "worker", "wait_for_layer_load")

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        _record(self.ctx, "worker", "save_kv_layer")
        for block_id, key in self.meta.saves:
            self.store.setdefault(key, {})[layer_name] = kv_layer[:, block_id].clone()

    def wait_for_save(self) -> None:
        _record(self.ctx, "worker", "wait_for_save")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        _record(self.ctx, "worker", "get_finished")
        options = self.ctx.options
        assert isinstance(options, RecorderOptions)
        sending = set(finished_req_ids) if options.delay_free else set()
        received, self.received = self.received, set()
        return sending, received if options.load_async else set()

    def shutdown(self) -> None:
        _record(self.ctx, "worker", "shutdown")


class RecorderConnector(KVConnector):
    """Assumes the built-in cache layout (block index in dimension 1)."""

    name: ClassVar[str] = "test_recorder"
    Options: ClassVar[type[PluginOptions]] = RecorderOptions
    scheduler_cls = RecorderScheduler
    worker_cls = RecorderWorker
    metadata_cls = RecorderMeta
