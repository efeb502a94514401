"""``cpu``: paged attention in C++ that reads the block table directly; the CPU default.

Every query row of the step (decodes and prefill chunks alike) goes to the native kernel
(``engine/kernels/cpu/native/paged_attention.cpp``): one work item per query row and KV head,
keys and values read in place from their blocks, float32 softmax (the logit soft cap
applied first when the layer has one, its attention sinks added to the denominator),
OpenMP over torch's threads. Nothing is gathered, padded or masked, so a step costs what
its cached context does. The new keys and values are written into their slots by the same
library. Against the ``torch`` backend's SDPA over gathered blocks, the 12 layers of the
benchmark model: 4-9x faster per decode step of 64 requests, 1.3-2.6x on prefill chunks up
to 1024 tokens (``benchmarks/attention_cpu.py``).

The backend is engine-kernels', an entry of ``engine.attention_backends`` like any
plugin's. It needs a C++ compiler at first use (the build is cached; see
``engine.kernels.cpu.native.library``); without one ``supports`` says so and the engine
falls back to engine-core's ``torch`` backend. Select either explicitly with
``--attention-backend cpu|torch``. Its KV cache has the ``torch`` backend's layout
(``[2, blocks, kv_heads, block_size, head_size]``: heads before tokens, each head's block
contiguous), so the two can be compared on one cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from engine.kernels.attention_spec import ANSWERED_SPEC_FIELDS, decoder_support
from engine.kernels.cpu import native
from engine.sdk.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionSpec,
    CommonAttentionMetadata,
    CudaGraphSupport,
    GraphMetadata,
)
from engine.sdk.capture import CaptureContext, GraphKind
from engine.sdk.support import Support

SUPPORTED_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class CpuAttentionMetadata:
    """One step's layout for the ``cpu`` backend.

    Attributes:
        slots: ``[num_actual_tokens]`` int64 cache slot of each new token.
        block_table: ``[num_reqs, max_blocks]`` int32, rows contiguous.
        requests: ``[num_actual_tokens]`` int32 request of each query row.
        positions: ``[num_actual_tokens]`` int32 position of each query row (it sees its
            request's keys ``0..position``).
    """

    slots: torch.Tensor
    block_table: torch.Tensor
    requests: torch.Tensor
    positions: torch.Tensor


class CpuGraphMetadata(GraphMetadata[CpuAttentionMetadata]):
    """The ``cpu`` backend's metadata in fixed buffers (the CPU step graph's)."""

    def __init__(self, builder: CpuAttentionMetadataBuilder, rows: int, max_reqs: int,
                 max_blocks: int) -> None:
        self.builder = builder
        self.slots = torch.zeros(rows, dtype=torch.int64)
        self.requests = torch.zeros(rows, dtype=torch.int32)
        self.positions = torch.zeros(rows, dtype=torch.int32)
        self.block_table = torch.zeros(max_reqs, max_blocks, dtype=torch.int32)
        self._arrays = [t.numpy() for t in self.tensors()]

    def tensors(self) -> list[torch.Tensor]:
        return [self.slots, self.requests, self.positions, self.block_table]

    def view(self, num_tokens: int) -> CpuAttentionMetadata:
        # The whole table: its row stride stays the same at every token count.
        return CpuAttentionMetadata(slots=self.slots[:num_tokens], block_table=self.block_table,
                                    requests=self.requests[:num_tokens],
                                    positions=self.positions[:num_tokens])

    def fill(self, common: CommonAttentionMetadata) -> None:
        step = self.builder.build(common)
        rows = step.slots.shape[0]
        slots, requests, positions, table = self._arrays
        slots[:rows] = step.slots.numpy()
        requests[:rows] = step.requests.numpy()
        positions[:rows] = step.positions.numpy()
        reqs, blocks = step.block_table.shape
        table[:reqs, :blocks] = step.block_table.numpy()


class CpuAttentionMetadataBuilder(AttentionMetadataBuilder[CpuAttentionMetadata]):
    def graph_metadata(self, ctx: CaptureContext) -> CpuGraphMetadata | None:
        """Fixed buffers for the CPU step graph (a row of the table per request)."""
        if ctx.kind is not GraphKind.CPU_STEP_GRAPH or min(
                ctx.max_tokens, ctx.max_reqs, ctx.max_blocks_per_req) < 1:
            return None
        return CpuGraphMetadata(self, ctx.max_tokens, ctx.max_reqs, ctx.max_blocks_per_req)

    def build(self, common: CommonAttentionMetadata) -> CpuAttentionMetadata:
        query_start = common.query_start_loc_cpu.numpy()
        seq_lens = common.seq_lens_cpu.numpy()
        query_lens = np.diff(query_start)
        requests = np.repeat(np.arange(len(query_lens), dtype=np.int32), query_lens)
        # Position of each row: its request's cached length plus its index in the request.
        rows = np.arange(len(requests))
        positions = seq_lens[requests] - query_lens[requests] + rows - query_start[requests]
        return CpuAttentionMetadata(
            slots=common.slot_mapping[: common.num_actual_tokens],
            block_table=common.block_table.contiguous(),
            requests=torch.from_numpy(requests),
            positions=torch.from_numpy(positions.astype(np.int32)),
        )


class CpuAttentionImpl(AttentionImpl[CpuAttentionMetadata]):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._kernels = native.load()

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        metadata: CpuAttentionMetadata, output: torch.Tensor,
    ) -> torch.Tensor:
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        num_tokens = metadata.slots.shape[0]
        self._kernels.write_kv(key[:num_tokens], value[:num_tokens], key_cache, value_cache,
                               metadata.slots)
        scale = self.params.scale
        self._kernels.paged_attention(
            query, key_cache, value_cache, metadata.block_table, metadata.requests,
            metadata.positions, output,
            scale if scale is not None else query.shape[-1] ** -0.5,
            self.params.spec.sliding_window, self.params.spec.logits_soft_cap,
            self.params.sinks)
        return output

    def capture_support(self, ctx: CaptureContext) -> Support:
        """The CPU step graph: ``forward`` is two native kernel calls."""
        if ctx.kind is GraphKind.CPU_STEP_GRAPH:
            return Support.yes()
        return Support.no(f"it runs on the CPU only, not in {ctx.kind.value}")


class CpuAttentionBackend(AttentionBackend):
    """Paged attention in C++ on the CPU, built on first use (needs a C++ compiler)."""

    name: ClassVar[str] = "cpu"
    cudagraph_support: ClassVar[CudaGraphSupport] = CudaGraphSupport.NEVER
    answered_spec_fields: ClassVar[frozenset[str]] = ANSWERED_SPEC_FIELDS

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl[Any]]:
        return CpuAttentionImpl

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder[Any]]:
        return CpuAttentionMetadataBuilder

    @classmethod
    def get_kv_cache_shape(
        cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, num_kv_heads, block_size, head_size)

    @classmethod
    def supports(cls, spec: AttentionSpec) -> Support:
        if spec.platform is not None and spec.platform.device_type != "cpu":
            return Support.no(f"runs on the CPU only, not {spec.platform.device_type}")
        hint = (" (the torch backend takes it: --attention-backend torch)"
                if spec.dtype == "float16" else "")
        answer = decoder_support(spec, SUPPORTED_DTYPES, hint, soft_cap=True, sinks=True)
        if not answer:
            return answer
        try:
            native.load()
        except native.NativeBuildError as exc:
            return Support.no(f"the C++ kernels are unavailable: {exc}")
        return Support.yes()
