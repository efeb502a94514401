"""``engine.attention_backends`` entry ``acme_sdpa``: paged attention with one batched SDPA call.

The builder turns the step's batch layout into, per request, the rows of its queries, the
cache slots of its context and a mask (causal, and the sliding window when the layers have
one); each layer then writes the step's keys and values into the cache, gathers every
request's context at once and runs one ``scaled_dot_product_attention`` over the padded
batch, in float32. No Python loop over requests or tokens. Runs on any torch device.

Cache layout: ``(2, num_blocks, block_size, num_kv_heads, head_size)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.sdk.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionSpec,
    CommonAttentionMetadata,
    CudaGraphSupport,
)
from engine.sdk.support import Support

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class SDPAMetadata:
    """One step of one attention group, padded to ``[num_reqs, max_query_len | max_seq_len]``.

    Attributes:
        num_actual_tokens: Real rows of the step.
        slot_mapping: ``[num_actual_tokens]`` cache slot of each row's key and value.
        query_rows: ``[num_reqs, max_q]`` row of each (request, query index); padding 0.
        query_valid: ``[num_reqs, max_q]`` bool: a real query.
        context_slots: ``[num_reqs, max_s]`` cache slot of each (request, context position).
        mask: ``[num_reqs, 1, max_q, max_s]`` bool: the key may be attended to.
    """

    num_actual_tokens: int
    slot_mapping: torch.Tensor
    query_rows: torch.Tensor
    query_valid: torch.Tensor
    context_slots: torch.Tensor
    mask: torch.Tensor


class SDPABuilder(AttentionMetadataBuilder[SDPAMetadata]):
    def build(self, common: CommonAttentionMetadata) -> SDPAMetadata:
        spec = self.ctx.spec
        device = common.block_table.device
        num_reqs, n = common.num_reqs, common.num_actual_tokens
        starts = common.query_start_loc[:num_reqs].long()
        query_lens = (common.query_start_loc[1:num_reqs + 1] - common.query_start_loc[
            :num_reqs]).long()
        seq_lens = common.seq_lens[:num_reqs].long()
        q_index = torch.arange(max(common.max_query_len, 1), device=device)
        query_valid = q_index[None, :] < query_lens[:, None]
        query_rows = torch.where(query_valid, starts[:, None] + q_index[None, :], 0)
        query_pos = (seq_lens - query_lens)[:, None] + q_index[None, :]
        k_pos = torch.arange(max(common.max_seq_len, 1), device=device)
        table = common.block_table[:num_reqs].long()
        block_index = (k_pos // spec.block_size).clamp(max=table.shape[1] - 1)
        context_slots = table[:, block_index] * spec.block_size + k_pos % spec.block_size
        mask = (k_pos[None, None, :] < seq_lens[:, None, None]) & (
            k_pos[None, None, :] <= query_pos[:, :, None])
        if spec.sliding_window is not None:
            mask &= k_pos[None, None, :] > query_pos[:, :, None] - spec.sliding_window
        # A padding query attends to position 0 only, so no softmax row is empty (no NaN).
        mask[..., 0] |= ~query_valid
        return SDPAMetadata(n, common.slot_mapping[:n], query_rows, query_valid,
                            context_slots, mask[:, None])


class SDPAImpl(AttentionImpl[SDPAMetadata]):
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: SDPAMetadata,
                output: torch.Tensor) -> torch.Tensor:
        spec, n = self.params.spec, metadata.num_actual_tokens
        keys = kv_cache[0].view(-1, spec.num_kv_heads, spec.head_size)
        values = kv_cache[1].view(-1, spec.num_kv_heads, spec.head_size)
        keys[metadata.slot_mapping] = key[:n].to(keys.dtype)
        values[metadata.slot_mapping] = value[:n].to(values.dtype)
        # [reqs, heads, len, head_size], in float32
        q = query[metadata.query_rows].float().transpose(1, 2)
        k = keys[metadata.context_slots].float().transpose(1, 2)
        v = values[metadata.context_slots].float().transpose(1, 2)
        group = spec.num_heads // spec.num_kv_heads
        if group > 1:
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=metadata.mask,
                                             scale=self.params.scale).transpose(1, 2)
        valid = metadata.query_valid
        output[metadata.query_rows[valid]] = out[valid].to(output.dtype)
        return output


class AcmeSDPABackend(AttentionBackend):
    """Paged attention by one padded SDPA call per layer: causal, GQA, sliding windows."""

    name = "acme_sdpa"
    cudagraph_support = CudaGraphSupport.NEVER  # shapes follow the step's lengths

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl[Any]]:
        return SDPAImpl

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder[Any]]:
        return SDPABuilder

    @classmethod
    def get_kv_cache_shape(cls, num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def supports(cls, spec: AttentionSpec) -> Support:
        if not spec.is_causal:
            return Support.no("only causal (decoder) attention is supported")
        if spec.dtype not in DTYPES:
            return Support.no(f"dtype {spec.dtype} is not supported ({', '.join(DTYPES)})")
        if spec.kv_cache_dtype != spec.dtype:
            return Support.no(f"kv_cache_dtype must equal dtype ({spec.dtype}), got "
                              f"{spec.kv_cache_dtype}")
        return Support.yes()  # any head size, block size, window and torch device
