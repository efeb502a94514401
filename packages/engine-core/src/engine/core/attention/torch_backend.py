"""``torch``: the CPU attention backend, batched SDPA over gathered paged-KV blocks.

Every step: write the step's keys and values into their cache slots, then for each group of
requests (see ``torch_grouping``) gather the group's blocks, and run one
``scaled_dot_product_attention`` with a boolean mask (causal with the cached prefix, and the
sliding window when set), or none for decodes of equal context length. No Python loop runs
per token, and none per request.

Grouped-query attention is folded into the query axis: the ``G = heads / kv_heads`` query
heads that share a KV head become ``G`` times as many query rows of that KV head
(``[n, kv_heads, G * Q, D]``), so the keys and values are never repeated per query head
(``enable_gqa`` does that on the CPU: ~3x slower for a 12/4-head decode step, measured).

A layer with a logit soft cap (``spec.logits_soft_cap``) or attention sinks
(``spec.has_sinks``) cannot use SDPA, which has no hook between the scores and the softmax:
its groups run the same product written out (``_explicit_attention``: scores, ``cap *
tanh(scores / cap)``, the mask, each head's sink logit joined to its scores, a float32
softmax, the sink's column dropped).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from engine.core.attention.torch_grouping import AttentionGroup, build_groups
from engine.sdk.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionSpec,
    CommonAttentionMetadata,
    CudaGraphSupport,
)
from engine.sdk.capture import CaptureContext, GraphKind
from engine.sdk.support import Support

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class TorchAttentionMetadata:
    """One step's layout for the torch backend.

    Attributes:
        slot_blocks: ``[num_tokens]`` block of each new token's KV.
        slot_offsets: ``[num_tokens]`` position of each new token in its block.
        num_actual_tokens: Real tokens of the step.
        groups: Requests attended together (see ``torch_grouping``).
    """

    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    num_actual_tokens: int
    groups: tuple[AttentionGroup, ...]


class TorchAttentionMetadataBuilder(AttentionMetadataBuilder[TorchAttentionMetadata]):
    def build(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        spec = self.ctx.spec
        groups = build_groups(
            common.query_start_loc_cpu.numpy(), common.seq_lens_cpu.numpy(),
            common.block_table.cpu(), spec.block_size, spec.sliding_window,
            spec.num_heads // spec.num_kv_heads,
        )
        device = common.slot_mapping.device
        if device.type != "cpu":
            groups = tuple(_to(g, device) for g in groups)
        slots = common.slot_mapping[: common.num_actual_tokens]
        return TorchAttentionMetadata(slots // spec.block_size, slots % spec.block_size,
                                      common.num_actual_tokens, groups)


def _to(group: AttentionGroup, device: torch.device) -> AttentionGroup:
    def moved(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    return AttentionGroup(
        q_index=moved(group.q_index), out_rows=moved(group.out_rows),
        out_positions=moved(group.out_positions), block_ids=moved(group.block_ids),
        mask=moved(group.mask) if group.mask is not None else None, kv_len=group.kv_len)


class TorchAttentionImpl(AttentionImpl[TorchAttentionMetadata]):
    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        metadata: TorchAttentionMetadata, output: torch.Tensor,
    ) -> torch.Tensor:
        num_tokens = metadata.num_actual_tokens
        head_size = key.shape[2]
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        blocks, offsets = metadata.slot_blocks, metadata.slot_offsets
        key_cache[blocks, :, offsets] = key[:num_tokens]
        value_cache[blocks, :, offsets] = value[:num_tokens]
        flat_out = output.view(output.shape[0], -1)
        num_kv_heads = key_cache.shape[1]
        for group in metadata.groups:
            n, q_len = group.q_index.shape
            k = _gather(key_cache, group.block_ids, group.kv_len)
            v = _gather(value_cache, group.block_ids, group.kv_len)
            # [n, Q, H, D] -> [n, KVH, G * Q, D]: row g * Q + i is query i of head kvh * G + g.
            q = query[group.q_index.view(-1)].view(n, q_len, num_kv_heads, -1, head_size)
            groups = q.shape[3]
            q = q.permute(0, 2, 3, 1, 4).reshape(n, num_kv_heads, groups * q_len, head_size)
            cap, sinks = self.params.spec.logits_soft_cap, self.params.sinks
            if cap is None and sinks is None:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask,
                                                     scale=self.params.scale)
            else:
                # Sink of row g * Q + i of KV head kvh: that of head kvh * G + g.
                rows = None if sinks is None else sinks.view(num_kv_heads, groups, 1).expand(
                    num_kv_heads, groups, q_len).reshape(1, num_kv_heads, groups * q_len, 1)
                out = _explicit_attention(q, k, v, group.mask, self.params.scale, cap, rows)
            # [n, KVH, G * Q, D] -> [n * Q, H * D]
            out = out.view(n, num_kv_heads, groups, q_len, head_size).permute(0, 3, 1, 2, 4)
            out = out.reshape(n * q_len, -1)
            flat_out.index_copy_(0, group.out_rows, out.index_select(0, group.out_positions))
        return output

    def capture_support(self, ctx: CaptureContext) -> Support:
        """CUDA graphs: the backend's ``cudagraph_support`` answers; never the CPU step graph."""
        if ctx.kind is GraphKind.CPU_STEP_GRAPH:
            return Support.no("SDPA over gathered blocks is torch compute, which the CPU step "
                              "graph cannot replay (the cpu backend can be recorded)")
        return super().capture_support(ctx)


def _explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        mask: torch.Tensor | None, scale: float, cap: float | None,
                        sinks: torch.Tensor | None) -> torch.Tensor:
    """SDPA written out, with the scores capped and the sinks in the softmax.

    ``softmax([mask(cap * tanh(q k^T * scale / cap)), sink])[..., :-1] v``, the semantics
    of transformers' eager Gemma 2 (cap) and GPT-OSS (sinks) attention, all in float32 (as
    SDPA and the ``cpu`` kernel compute internally: scores rounded to bfloat16 would move
    the weights of large scores by percents), the result in ``v``'s dtype. ``mask``
    (boolean, True = visible) broadcasts over the scores ``[n, KVH, rows, L]``; ``sinks``
    is ``[1, KVH, rows, 1]`` float32.
    """
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink_column = sinks.to(scores.device, torch.float32).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, v.float()).to(v.dtype)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor,
            kv_len: int | None = None) -> torch.Tensor:
    """``[n, kv_heads, nb * block_size, D]``: the blocks of each request, contiguous.

    With ``kv_len``, only the first ``kv_len`` keys of each request.
    """
    n, nb = block_ids.shape
    _, num_heads, block_size, head_size = cache.shape
    blocks = cache.index_select(0, block_ids.view(-1)).view(n, nb, num_heads, block_size,
                                                             head_size)
    keys = blocks.transpose(1, 2).reshape(n, num_heads, nb * block_size, head_size)
    return keys if kv_len is None else keys[:, :, :kv_len]


class TorchAttentionBackend(AttentionBackend):
    """Paged attention with plain torch ops; the CPU default, also correct on any device."""

    name: ClassVar[str] = "torch"
    cudagraph_support: ClassVar[CudaGraphSupport] = CudaGraphSupport.NEVER
    answered_spec_fields: ClassVar[frozenset[str]] = frozenset({"logits_soft_cap",
                                                                 "has_sinks"})

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl[Any]]:
        return TorchAttentionImpl

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder[Any]]:
        return TorchAttentionMetadataBuilder

    @classmethod
    def get_kv_cache_shape(
        cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        # Heads before tokens: a request's gathered blocks become [heads, tokens, D] with
        # one copy, the layout the attention matmuls read fastest.
        return (2, num_blocks, num_kv_heads, block_size, head_size)

    @classmethod
    def supports(cls, spec: AttentionSpec) -> Support:
        if spec.dtype not in SUPPORTED_DTYPES:
            return Support.no(f"dtype {spec.dtype} not supported; supported: "
                              f"{', '.join(SUPPORTED_DTYPES)}")
        if spec.kv_cache_dtype != spec.dtype:
            return Support.no(f"kv_cache_dtype must equal dtype ({spec.dtype}), got "
                              f"{spec.kv_cache_dtype}")
        if not spec.is_causal:
            return Support.no("only causal (decoder) attention is supported")
        if spec.num_heads % spec.num_kv_heads:
            return Support.no(f"num_heads {spec.num_heads} is not a multiple of num_kv_heads "
                              f"{spec.num_kv_heads}")
        return Support.yes()  # any sliding window, logits_soft_cap and sinks
