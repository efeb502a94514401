"""``test_capture_paged``: an attention backend with a metadata builder of its own, recorded.

Its builder is no class of the engine's: it builds its own metadata type and hands the CPU
step graph fixed buffers for it (``graph_metadata``, SDK 1.1). Its implementation composes
the engine's ``cpu`` backend's (found through its entry point), which reads the four
fields by name. ``FILLS`` counts the steps whose layout it copied into the graph's buffers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, ClassVar

import numpy as np
import torch

from engine.sdk import CaptureContext, GraphKind, Support
from engine.sdk.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionImplParams,
    AttentionMetadataBuilder,
    AttentionSpec,
    CommonAttentionMetadata,
    CudaGraphSupport,
    GraphMetadata,
)
from engine.sdk.groups import ATTENTION_BACKENDS

#: Steps whose layout ``FixedMetadata.fill`` copied in, in this process.
FILLS: dict[str, int] = {"fill": 0}


@functools.cache
def engine_cpu_backend() -> type[AttentionBackend] | None:
    for entry in entry_points(group=ATTENTION_BACKENDS, name="cpu"):
        if entry.dist is not None and entry.dist.name == "engine-kernels":
            backend: type[AttentionBackend] = entry.load()
            return backend
    return None


@dataclass(frozen=True)
class PagedMetadata:
    slots: torch.Tensor  # [tokens] int64
    block_table: torch.Tensor  # [requests, blocks] int32
    requests: torch.Tensor  # [tokens] int32: each row's request
    positions: torch.Tensor  # [tokens] int32: each row's position


def layout(common: CommonAttentionMetadata) -> PagedMetadata:
    starts = common.query_start_loc_cpu.numpy()
    lens = np.diff(starts)
    requests = np.repeat(np.arange(len(lens), dtype=np.int32), lens)
    rows = np.arange(len(requests))
    positions = common.seq_lens_cpu.numpy()[requests] - lens[requests] + rows - starts[requests]
    return PagedMetadata(common.slot_mapping[:common.num_actual_tokens],
                         common.block_table.contiguous(), torch.from_numpy(requests),
                         torch.from_numpy(positions.astype(np.int32)))


class FixedMetadata(GraphMetadata[PagedMetadata]):
    def __init__(self, ctx: CaptureContext) -> None:
        self.slots = torch.zeros(ctx.max_tokens, dtype=torch.int64)
        self.requests = torch.zeros(ctx.max_tokens, dtype=torch.int32)
        self.positions = torch.zeros(ctx.max_tokens, dtype=torch.int32)
        self.table = torch.zeros(ctx.max_reqs, ctx.max_blocks_per_req, dtype=torch.int32)

    def tensors(self) -> list[torch.Tensor]:
        return [self.slots, self.requests, self.positions, self.table]

    def view(self, num_tokens: int) -> PagedMetadata:
        return PagedMetadata(self.slots[:num_tokens], self.table, self.requests[:num_tokens],
                             self.positions[:num_tokens])

    def fill(self, common: CommonAttentionMetadata) -> None:
        step, rows = layout(common), common.num_actual_tokens
        self.slots[:rows] = step.slots
        self.requests[:rows] = step.requests
        self.positions[:rows] = step.positions
        reqs, blocks = step.block_table.shape
        self.table[:reqs, :blocks] = step.block_table
        FILLS["fill"] += 1


class PagedBuilder(AttentionMetadataBuilder[PagedMetadata]):
    def build(self, common: CommonAttentionMetadata) -> PagedMetadata:
        return layout(common)

    def graph_metadata(self, ctx: CaptureContext) -> FixedMetadata | None:
        return FixedMetadata(ctx) if ctx.kind is GraphKind.CPU_STEP_GRAPH else None


class PagedImpl(AttentionImpl[PagedMetadata]):
    def __init__(self, params: AttentionImplParams) -> None:
        super().__init__(params)
        backend = engine_cpu_backend()
        if backend is None:
            raise RuntimeError("test_capture_paged: the engine's 'cpu' backend is not installed")
        self.inner = backend.get_impl_cls()(params)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: PagedMetadata,
                output: torch.Tensor) -> torch.Tensor:
        return self.inner.forward(query, key, value, kv_cache, metadata, output)

    def capture_support(self, ctx: CaptureContext) -> Support:
        return self.inner.capture_support(ctx)


class PagedBackend(AttentionBackend):
    """The engine's ``cpu`` kernels behind a builder of this package's own."""

    name: ClassVar[str] = "test_capture_paged"
    cudagraph_support: ClassVar[CudaGraphSupport] = CudaGraphSupport.NEVER

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl[Any]]:
        return PagedImpl

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder[Any]]:
        return PagedBuilder

    @classmethod
    def get_kv_cache_shape(cls, num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int) -> tuple[int, ...]:
        backend = engine_cpu_backend()
        assert backend is not None
        return backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def supports(cls, spec: AttentionSpec) -> Support:
        backend = engine_cpu_backend()
        if backend is None:
            return Support.no("the engine's 'cpu' attention backend is not installed")
        return backend.supports(spec)
