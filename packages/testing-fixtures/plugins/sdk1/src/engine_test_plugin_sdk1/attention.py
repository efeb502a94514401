"""Attention backend plugin: correct paged attention in plain torch, one request at a time.

KV-cache layout: ``(2, num_blocks, block_size, num_kv_heads, head_size)`` (keys, values).
Each step writes the new keys and values at ``slot_mapping``, then for every request
gathers its blocks through ``block_table`` and runs causal SDPA over its context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from pydantic import Field

from engine.sdk import (
    AttentionBackend,
    AttentionImpl,
    AttentionImplParams,
    AttentionMetadataBuilder,
    AttentionSpec,
    CommonAttentionMetadata,
    CudaGraphSupport,
    PluginOptions,
    Support,
)
from engine_test_plugin_sdk1.counters import count

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Sdk1AttentionMetadata:
    """One step's layout as this backend uses it."""

    num_reqs: int
    num_actual_tokens: int
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    query_starts: tuple[int, ...]
    seq_lens: tuple[int, ...]
    block_size: int


class Sdk1MetadataBuilder(AttentionMetadataBuilder[Sdk1AttentionMetadata]):
    def build(self, common: CommonAttentionMetadata) -> Sdk1AttentionMetadata:
        count("sdk1_paged.build")
        starts = tuple(int(s) for s in common.query_start_loc_cpu.tolist())
        seq_lens = tuple(int(s) for s in common.seq_lens_cpu.tolist())
        if len(starts) != common.num_reqs + 1 or starts[-1] != common.num_actual_tokens:
            raise ValueError(f"sdk1_paged: query_start_loc {starts} does not match "
                             f"{common.num_reqs} requests / {common.num_actual_tokens} tokens")
        return Sdk1AttentionMetadata(
            num_reqs=common.num_reqs, num_actual_tokens=common.num_actual_tokens,
            slot_mapping=common.slot_mapping, block_table=common.block_table,
            query_starts=starts, seq_lens=seq_lens, block_size=self.ctx.spec.block_size)


class Sdk1AttentionImpl(AttentionImpl[Sdk1AttentionMetadata]):
    def __init__(self, params: AttentionImplParams) -> None:
        super().__init__(params)
        options = params.options
        if not isinstance(options, Sdk1PagedAttentionBackend.Options):
            options = Sdk1PagedAttentionBackend.Options()  # built outside the engine
        self.upcast = options.upcast

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        kv_cache: torch.Tensor, metadata: Sdk1AttentionMetadata, output: torch.Tensor,
    ) -> torch.Tensor:
        count("sdk1_paged.forward")
        spec = self.params.spec
        n = metadata.num_actual_tokens
        heads, size = spec.num_kv_heads, spec.head_size
        slots = metadata.slot_mapping[:n]
        kv_cache[0].view(-1, heads, size)[slots] = key[:n]
        kv_cache[1].view(-1, heads, size)[slots] = value[:n]
        group = spec.num_heads // spec.num_kv_heads
        for i in range(metadata.num_reqs):
            start, end = metadata.query_starts[i], metadata.query_starts[i + 1]
            seq_len = metadata.seq_lens[i]
            num_blocks = -(-seq_len // metadata.block_size)
            blocks = metadata.block_table[i, :num_blocks].long()
            k = kv_cache[0][blocks].reshape(-1, heads, size)[:seq_len]
            v = kv_cache[1][blocks].reshape(-1, heads, size)[:seq_len]
            q = query[start:end]
            positions = torch.arange(seq_len - (end - start), seq_len, device=q.device)
            keys = torch.arange(seq_len, device=q.device)
            mask = keys[None, :] <= positions[:, None]
            dtype = torch.float32 if self.upcast else q.dtype
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1).to(dtype),
                k.repeat_interleave(group, 1).transpose(0, 1).to(dtype),
                v.repeat_interleave(group, 1).transpose(0, 1).to(dtype),
                attn_mask=mask, scale=self.params.scale,
            )
            output[start:end] = out.transpose(0, 1).to(output.dtype)
        return output


class Sdk1PagedAttentionBackend(AttentionBackend):
    """Paged attention, causal, full context (no sliding window), any device."""

    name: ClassVar[str] = "sdk1_paged"
    cudagraph_support: ClassVar[CudaGraphSupport] = CudaGraphSupport.NEVER

    class Options(PluginOptions):
        upcast: bool = Field(True, description="compute attention in float32")

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl[Any]]:
        return Sdk1AttentionImpl

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder[Any]]:
        return Sdk1MetadataBuilder

    @classmethod
    def get_kv_cache_shape(
        cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def supports(cls, spec: AttentionSpec) -> Support:
        count("sdk1_paged.supports")
        if spec.dtype not in SUPPORTED_DTYPES:
            return Support.no(f"dtype {spec.dtype} is not supported; supported: "
                              f"{', '.join(SUPPORTED_DTYPES)}")
        if spec.kv_cache_dtype != spec.dtype:
            return Support.no(f"kv_cache_dtype must equal dtype ({spec.dtype}), got "
                              f"{spec.kv_cache_dtype}")
        if spec.sliding_window is not None:
            return Support.no("sliding window attention is not supported (full context only)")
        if not spec.is_causal:
            return Support.no("only causal attention is supported")
        if spec.platform is not None and spec.platform.device_type not in ("cpu", "cuda"):
            return Support.no(f"runs on cpu and cuda only, found {spec.platform.device_type}")
        return Support.yes()
