"""The worker side of ``offload``: copies blocks between this rank's KV cache and the store.

A stored block is every layer's slice of one block id, stacked in layer order
(``[num_layers, *block_shape]``, this rank's heads only). The block dimension of each
layer's cache is found at registration (the dimension of size ``num_blocks``, dimension 1
for the built-in layouts); the layout is written next to the files, and an engine whose
layout differs refuses the directory instead of misreading it.

Per step:

* ``start_load_kv``: read the step's loads (file or memory); with ``load_async`` a
  background thread reads and copies them into the cache and ``get_finished`` reports each
  request once all its blocks are in place; otherwise each layer's slice is copied in
  ``wait_for_layer_load``, just before that layer's attention.
* ``save_kv_layer``: copy the layer's slices of the step's saves out of the cache (one
  ``index_select``); ``wait_for_save``: stack them per block and write them (a file is
  written under a temporary name and renamed, so readers never see half a block).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import uuid
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from engine.core.kv_connectors._offload_common import (
    BlockTransfer,
    OffloadMeta,
    block_file,
    namespace_fields,
    namespace_id,
    options_of,
    rank_dir,
)
from engine.sdk.kv_connector import KVConnectorContext, KVConnectorMetadata, KVConnectorWorker

logger = logging.getLogger("engine.kv_connector.offload")


class OffloadWorker(KVConnectorWorker):
    """See the module docstring."""

    def __init__(self, ctx: KVConnectorContext) -> None:
        super().__init__(ctx)
        options = options_of(ctx)
        self.directory: Path | None = None
        if options.path is not None:
            namespace = namespace_id(namespace_fields(ctx, options))
            self.directory = rank_dir(Path(options.path).expanduser(), namespace, ctx.tp_rank)
            self.directory.mkdir(parents=True, exist_ok=True)
        self.memory: dict[str, torch.Tensor] = {}  # key -> stacked block (CPU memory store)
        self.layers: list[torch.Tensor] = []
        self.layer_index: dict[str, int] = {}
        self.block_dim = 1
        self.block_shape: tuple[int, ...] = ()
        self.meta = OffloadMeta()
        self._layer_loads: list[tuple[int, torch.Tensor]] = []
        self._save_parts: list[torch.Tensor | None] = []
        self._save_ids: torch.Tensor | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._jobs: list[Future[None]] = []
        self._received: set[str] = set()
        self._lock = threading.Lock()

    # -- registration ----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = list(self.ctx.layer_names) or list(kv_caches)
        missing = [name for name in names if name not in kv_caches]
        if missing:
            raise ValueError(f"offload: no KV cache for layers {missing}")
        self.layers = [kv_caches[name] for name in names]
        self.layer_index = {name: index for index, name in enumerate(names)}
        first = self.layers[0]
        if any(t.shape != first.shape or t.dtype != first.dtype for t in self.layers):
            raise ValueError("offload: every layer's KV cache must have one shape and dtype")
        self.block_dim = _block_dim(tuple(first.shape), self.ctx.num_blocks)
        self.block_shape = tuple(s for d, s in enumerate(first.shape) if d != self.block_dim)
        self._save_parts = [None] * len(self.layers)
        if self.directory is not None:
            self._check_layout(first.dtype)

    def _check_layout(self, dtype: torch.dtype) -> None:
        assert self.directory is not None
        layout = {"block_dim": self.block_dim, "block_shape": list(self.block_shape),
                  "dtype": str(dtype).removeprefix("torch."), "num_layers": len(self.layers)}
        path = self.directory / "layout.json"
        if path.is_file():
            found = json.loads(path.read_text())
            if found != layout:
                raise ValueError(
                    f"offload: {self.directory} holds blocks in layout {found}, this engine's "
                    f"KV cache is {layout} (another attention backend?); use another path or "
                    f"a --kv-connector-option namespace=...")
            return
        _write_atomically(path, json.dumps(layout).encode())

    # -- loads -----------------------------------------------------------------------

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        if not isinstance(metadata, OffloadMeta):
            raise TypeError(f"offload: expected OffloadMeta, got {type(metadata).__name__}")
        self.meta = metadata
        self._save_ids = (torch.tensor([save.block_id for save in metadata.saves],
                                       device=self.layers[0].device)
                          if metadata.saves else None)
        if not metadata.loads:
            self._layer_loads = []
            return
        blocks = [(load, self._read(load.key)) for load in metadata.loads]
        if not metadata.load_async:
            self._layer_loads = [(load.block_id, block) for load, block in blocks]
            return
        self._layer_loads = []
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload-load")
        self._jobs.append(self._pool.submit(self._load_in_background, blocks))

    def _read(self, key: str) -> torch.Tensor:
        """The stored block (a CPU tensor ``[num_layers, *block_shape]``)."""
        if self.directory is None:
            block = self.memory.get(key)
            if block is None:
                raise KeyError(f"offload: block {key[:12]} is not in CPU memory")
            return block
        path = block_file(self.directory, key)
        data = bytearray(path.read_bytes())
        dtype = self.layers[0].dtype
        shape = (len(self.layers), *self.block_shape)
        expected = dtype.itemsize * int(torch.Size(shape).numel())
        if len(data) != expected:
            raise ValueError(f"offload: {path} has {len(data)} bytes, a block has {expected}")
        return torch.frombuffer(data, dtype=torch.uint8).view(dtype).view(shape)

    def _load_in_background(self, blocks: Sequence[tuple[BlockTransfer, torch.Tensor]]) -> None:
        for load, block in blocks:
            for index, cache in enumerate(self.layers):
                cache.select(self.block_dim, load.block_id).copy_(block[index])
        with self._lock:
            self._received.update(load.req_id for load, _ in blocks)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._layer_loads:
            return
        index = self.layer_index[layer_name]
        cache = self.layers[index]
        for block_id, block in self._layer_loads:
            cache.select(self.block_dim, block_id).copy_(block[index], non_blocking=True)

    # -- saves -----------------------------------------------------------------------

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        ids = self._save_ids
        if ids is None:
            return
        part = kv_layer.index_select(self.block_dim, ids).to("cpu")
        self._save_parts[self.layer_index[layer_name]] = part

    def wait_for_save(self) -> None:
        saves, parts = self.meta.saves, self._save_parts
        self._save_parts = [None] * len(self.layers)
        if saves:
            if any(part is None for part in parts):
                raise RuntimeError("offload: save_kv_layer was not called for every layer "
                                   "this step; the blocks to save are incomplete")
            stacked = torch.stack([p for p in parts if p is not None])
            for number, save in enumerate(saves):
                block = stacked.select(self.block_dim + 1, number).contiguous()
                self._store(save.key, block)
        for key in self.meta.evictions:
            self.memory.pop(key, None)
        self._layer_loads = []

    def _store(self, key: str, block: torch.Tensor) -> None:
        if self.directory is None:
            self.memory[key] = block
            return
        path = block_file(self.directory, key)
        if path.is_file():
            return
        path.parent.mkdir(exist_ok=True)
        _write_atomically(path, block.view(torch.uint8).numpy().tobytes())

    # -- completion ------------------------------------------------------------------

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        for job in [j for j in self._jobs if j.done()]:
            self._jobs.remove(job)
            job.result()  # a failed background load raises here
        with self._lock:
            received, self._received = self._received, set()
        return set(), received

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _block_dim(shape: tuple[int, ...], num_blocks: int) -> int:
    """The dimension of a layer's cache that indexes blocks."""
    if len(shape) > 1 and shape[1] == num_blocks:
        return 1
    matches = [d for d, size in enumerate(shape) if size == num_blocks]
    if len(matches) != 1:
        raise ValueError(f"offload: cannot tell which dimension of the KV cache shape "
                         f"{shape} indexes its {num_blocks} blocks")
    return matches[0]


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "wb") as file:
        file.write(data)
    os.replace(tmp, path)
