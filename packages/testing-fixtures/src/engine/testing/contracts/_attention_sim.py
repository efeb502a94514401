"""A paged KV cache and step layouts for the attention-backend suite, with a dense reference.

:class:`AttentionSim` plays the engine's part around one backend: it hands out KV blocks
from a pool (shuffled, block 0 never), lays out each step exactly as the engine's model
runner does (:class:`~engine.sdk.attention.CommonAttentionMetadata`, padding rows pointing
into the null block), builds the metadata once per step with the backend's builder, calls
every layer's ``forward`` with query/key/value *views* of one fused ``qkv`` tensor (as a
model's projection produces them), and keeps each request's keys and values of every
layer in plain tensors. The reference is dense attention over those, in float64::

    out[t, h] = softmax_j(q[t, h] . k[j, h // G] * scale) v[j, h // G]
                over keys j <= position(t) (and j > position(t) - window)

with the spec's options: each score capped to ``cap * tanh(score / cap)`` before the
softmax (``logits_soft_cap``), and each head's sink logit (``has_sinks``: random per layer,
handed to the implementation as ``AttentionImplParams.sinks``) joining the softmax and
dropped after.

so a key written to the wrong slot, read through the wrong block, read past a request's
context, or a row left unwritten, shows as a mismatch at that row.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.sdk.attention import (
    AttentionBackend,
    AttentionContext,
    AttentionImpl,
    AttentionImplParams,
    AttentionSpec,
    CommonAttentionMetadata,
)
from engine.sdk.plugin import PluginOptions


@dataclass
class CachedRequest:
    """One request's blocks and, per layer, every key and value it has cached."""

    name: str
    block_ids: list[int] = field(default_factory=list)
    keys: list[torch.Tensor] = field(default_factory=list)    # per layer [seq_len, kvh, D]
    values: list[torch.Tensor] = field(default_factory=list)

    @property
    def seq_len(self) -> int:
        return 0 if not self.keys else int(self.keys[0].shape[0])


@dataclass(frozen=True)
class RowCheck:
    """Where one request's rows are in a step, and what they mean (for messages)."""

    request: str
    start: int
    num_tokens: int
    seq_len: int
    ends_on_block_boundary: bool = False

    def describe(self) -> str:
        cached = self.seq_len - self.num_tokens
        kind = ("decode" if self.num_tokens == 1 and cached else
                "full prompt" if not cached else "chunked prefill over a cached prefix")
        boundary = ", ends on a block boundary" if self.ends_on_block_boundary else ""
        return (f"request {self.request!r} ({kind}: {self.num_tokens} new tokens, "
                f"{cached} cached{boundary})")


class AttentionSim:
    """One attention group of ``num_layers`` layers of ``backend`` over a shared block pool."""

    def __init__(self, backend: type[AttentionBackend], spec: AttentionSpec, *,
                 num_blocks: int, max_blocks_per_req: int, num_layers: int, device: str,
                 options: PluginOptions, seed: int) -> None:
        self.backend, self.spec, self.device = backend, spec, torch.device(device)
        self.dtype: torch.dtype = getattr(torch, spec.dtype)
        self.max_blocks_per_req = max_blocks_per_req
        self.rng = torch.Generator().manual_seed(seed)
        self.order = random.Random(seed)
        free = list(range(1, num_blocks))  # block 0 is the null block
        self.order.shuffle(free)
        self.free_block_ids = free
        self.layer_names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(num_layers))
        shape = backend.get_kv_cache_shape(num_blocks, spec.block_size, spec.num_kv_heads,
                                           spec.head_size)
        kv_dtype = getattr(torch, spec.kv_cache_dtype)
        self.kv_caches = [torch.zeros(tuple(shape), dtype=kv_dtype, device=self.device)
                          for _ in self.layer_names]
        ctx = AttentionContext(
            plugin_name=backend.name, options=options, process="worker", spec=spec,
            layer_names=self.layer_names, device=str(self.device), max_num_reqs=16,
            max_num_batched_tokens=4096, max_model_len=max_blocks_per_req * spec.block_size)
        self.builder = backend.get_builder_cls()(ctx)
        self.scale = spec.head_size ** -0.5
        self.sinks = [torch.randn(spec.num_heads, generator=self.rng) * 2 + 1
                      if spec.has_sinks else None for _ in self.layer_names]
        self.impls: list[AttentionImpl[Any]] = [
            backend.get_impl_cls()(AttentionImplParams(
                spec=spec, layer_name=name, scale=self.scale, options=options,
                sinks=None if sinks is None else sinks.to(self.device)))
            for name, sinks in zip(self.layer_names, self.sinks, strict=True)]
        self.requests: dict[str, CachedRequest] = {}

    # -- blocks --------------------------------------------------------------------------

    def _grow(self, request: CachedRequest, seq_len: int) -> None:
        need = math.ceil(seq_len / self.spec.block_size) - len(request.block_ids)
        if need > len(self.free_block_ids):
            raise AssertionError("attention suite bug: the block pool is too small")
        for _ in range(need):
            request.block_ids.append(self.free_block_ids.pop())

    def finish(self, name: str) -> None:
        """Free a request's blocks (their content stays: a later request reuses them)."""
        request = self.requests.pop(name)
        self.free_block_ids.extend(request.block_ids)
        self.order.shuffle(self.free_block_ids)

    # -- one step ------------------------------------------------------------------------

    def _random(self, *shape: int, junk: bool) -> torch.Tensor:
        values = torch.randn(*shape, generator=self.rng, dtype=torch.float32)
        if junk:  # large and offset: any weight on such a key or value shows in the output
            values = values * 4 + 8
        return values.to(self.dtype)

    def step(self, batch: list[tuple[str, int]], *, num_padding: int = 0,
             junk: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor], list[RowCheck]]:
        """Run one step of ``(request, new tokens)`` in this order, plus padding rows.

        Returns:
            Per layer the backend's output (``[num_tokens, heads, D]``) and the reference
            (float64, real rows only), and where each request's rows are.
        """
        spec, bs = self.spec, self.spec.block_size
        heads, kv_heads, size = spec.num_heads, spec.num_kv_heads, spec.head_size
        rows: list[RowCheck] = []
        slots: list[int] = []
        start = 0
        for name, num_new in batch:
            request = self.requests.setdefault(name, CachedRequest(name))
            seq_len = request.seq_len + num_new
            self._grow(request, seq_len)
            for pos in range(request.seq_len, seq_len):
                slots.append(request.block_ids[pos // bs] * bs + pos % bs)
            rows.append(RowCheck(name, start, num_new, seq_len, seq_len % bs == 0))
            start += num_new
        num_actual = start
        slots += [i % bs for i in range(num_padding)]  # padding: into the null block
        num_tokens = num_actual + num_padding
        common = self._common(batch, rows, slots, num_actual)
        metadata = self.builder.build(common)
        outputs, references = [], []
        for layer, impl in enumerate(self.impls):
            width = (heads + 2 * kv_heads) * size
            qkv = self._random(num_tokens, width, junk=False).to(self.device)
            if num_padding:
                qkv[num_actual:] = self._random(num_padding, width, junk=True).to(self.device)
            if junk:
                qkv[:num_actual, heads * size:] = self._random(
                    num_actual, 2 * kv_heads * size, junk=True).to(self.device)
            q = qkv[:, : heads * size].view(num_tokens, heads, size)
            k = qkv[:, heads * size:(heads + kv_heads) * size].view(num_tokens, kv_heads, size)
            v = qkv[:, (heads + kv_heads) * size:].view(num_tokens, kv_heads, size)
            output = torch.full((num_tokens, heads, size), float("nan"), dtype=self.dtype,
                                device=self.device)
            result = impl.forward(q, k, v, self.kv_caches[layer], metadata, output)
            if result is not output:
                raise AssertionError(f"{type(impl).__qualname__}.forward must return the "
                                     f"output tensor it was given")
            references.append(self._reference(layer, rows, q.cpu(), k.cpu(), v.cpu()))
            outputs.append(output[:num_actual].cpu())
        return outputs, references, rows

    def _common(self, batch: list[tuple[str, int]], rows: list[RowCheck], slots: list[int],
                num_actual: int) -> CommonAttentionMetadata:
        starts = [0] + [r.start + r.num_tokens for r in rows]
        seq_lens = [r.seq_len for r in rows]
        table = torch.zeros(len(batch), self.max_blocks_per_req, dtype=torch.int32)
        for i, (name, _) in enumerate(batch):
            block_ids = self.requests[name].block_ids
            table[i, : len(block_ids)] = torch.tensor(block_ids, dtype=torch.int32)
        query_start_loc = torch.tensor(starts, dtype=torch.int32)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
        return CommonAttentionMetadata(
            query_start_loc=query_start_loc.to(self.device), query_start_loc_cpu=query_start_loc,
            seq_lens=seq_lens_t.to(self.device), seq_lens_cpu=seq_lens_t,
            block_table=table.to(self.device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64).to(self.device),
            num_reqs=len(batch), num_actual_tokens=num_actual,
            max_query_len=max(r.num_tokens for r in rows), max_seq_len=max(seq_lens))

    def _reference(self, layer: int, rows: list[RowCheck], q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> torch.Tensor:
        """Dense attention of the step's real rows (float64); stores the new keys/values."""
        spec = self.spec
        group = spec.num_heads // spec.num_kv_heads
        out = torch.empty(sum(r.num_tokens for r in rows), spec.num_heads, spec.head_size,
                          dtype=torch.float64)
        for row in rows:
            request = self.requests[row.request]
            new = slice(row.start, row.start + row.num_tokens)
            if len(request.keys) <= layer:
                request.keys.append(k[new].clone())
                request.values.append(v[new].clone())
            else:
                request.keys[layer] = torch.cat((request.keys[layer], k[new]))
                request.values[layer] = torch.cat((request.values[layer], v[new]))
            keys = request.keys[layer].double().repeat_interleave(group, 1)
            values = request.values[layer].double().repeat_interleave(group, 1)
            positions = torch.arange(row.seq_len - row.num_tokens, row.seq_len)
            key_pos = torch.arange(row.seq_len)
            visible = key_pos[None, :] <= positions[:, None]
            if spec.sliding_window is not None:
                visible &= key_pos[None, :] > positions[:, None] - spec.sliding_window
            scores = torch.einsum("qhd,khd->hqk", q[new].double(), keys) * self.scale
            cap = spec.logits_soft_cap
            if cap is not None:
                scores = cap * torch.tanh(scores / cap)
            scores = scores.masked_fill(~visible, float("-inf"))
            sinks = self.sinks[layer]
            if sinks is None:
                probs = scores.softmax(-1)
            else:  # one more column per head: its sink, dropped after the softmax
                column = sinks.double()[:, None, None].expand(-1, scores.shape[1], 1)
                probs = torch.cat((scores, column), -1).softmax(-1)[..., :-1]
            out[new] = torch.einsum("hqk,khd->qhd", probs, values)
        return out
