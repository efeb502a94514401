"""A random paged-attention step and its per-request reference, for backend tests.

:func:`run_step` writes a mixed step (decodes, chunks over a cached prefix, whole prompts)
into a backend's KV cache through its own builder and implementation, and
:func:`reference` computes each request's attention directly, one query at a time, with
the options an :class:`~engine.sdk.attention.AttentionSpec` may carry (sliding window,
logit soft cap) and attention sinks: the two must agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from engine.sdk.attention import (
    AttentionBackend,
    AttentionContext,
    AttentionImplParams,
    AttentionSpec,
    CommonAttentionMetadata,
)

#: (cached tokens, new tokens) per request: decodes, chunks over a prefix, whole prompts.
MIXED = ((7, 1), (0, 9), (12, 1), (5, 6), (0, 1), (3, 2), (20, 1), (0, 30), (2, 40))
#: Decodes of one context length (the torch backend's unmasked path).
EQUAL_DECODES = ((9, 1),) * 5


@dataclass(frozen=True)
class StepResult:
    """A step's inputs and the backend's output.

    Attributes:
        query: ``[tokens, heads, D]`` the step's queries.
        output: ``[tokens, heads, D]`` what the backend computed.
        contexts: Per request: all its keys and values ``[total, kv_heads, D]`` and its
            cached length (its queries sit at positions ``cached..``).
        query_start: ``[requests + 1]`` the requests' first rows.
    """

    query: torch.Tensor
    output: torch.Tensor
    contexts: list[tuple[torch.Tensor, torch.Tensor, int]]
    query_start: list[int]


def run_step(backend: type[AttentionBackend], spec: AttentionSpec, scale: float, *,
             reqs: tuple[tuple[int, int], ...] = MIXED, seed: int = 0,
             params: dict[str, Any] | None = None) -> StepResult:
    """One step of ``reqs`` through ``backend`` (blocks scattered, the prefix cached).

    ``params``: more :class:`AttentionImplParams` fields for the implementation.
    """
    dtype = getattr(torch, spec.dtype)
    heads, kv_heads, dim, block = spec.num_heads, spec.num_kv_heads, spec.head_size, \
        spec.block_size
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(math.ceil((c + n) / block) for c, n in reqs)
    num_blocks = 1 + sum(math.ceil((c + n) / block) for c, n in reqs)
    cache = torch.zeros(backend.get_kv_cache_shape(num_blocks, block, kv_heads, dim),
                        dtype=dtype)
    free = [1 + i for i in torch.randperm(num_blocks - 1, generator=gen).tolist()]
    contexts, rows, slots, queries, keys, values = [], [], [], [], [], []
    for cached, new in reqs:
        total = cached + new
        blocks = [free.pop() for _ in range(math.ceil(total / block))]
        k_all = torch.randn(total, kv_heads, dim, generator=gen).to(dtype)
        v_all = torch.randn(total, kv_heads, dim, generator=gen).to(dtype)
        slots.append([blocks[p // block] * block + p % block for p in range(total)])
        queries.append(torch.randn(new, heads, dim, generator=gen).to(dtype))
        keys.append(k_all[cached:])
        values.append(v_all[cached:])
        contexts.append((k_all, v_all, cached))
        rows.append(blocks + [0] * (max_blocks - len(blocks)))
    # The cached prefixes, written by the backend itself (whatever its cache layout).
    prefix = [(i, p) for i, (cached, _) in enumerate(reqs) for p in range(cached)]
    if prefix:
        _write(backend, spec, scale, cache, [slots[i][p] for i, p in prefix],
               torch.stack([contexts[i][0][p] for i, p in prefix]),
               torch.stack([contexts[i][1][p] for i, p in prefix]), params)
    qlens = [n for _, n in reqs]
    query_start = [0]
    for n in qlens:
        query_start.append(query_start[-1] + n)
    qsl = torch.tensor(query_start, dtype=torch.int32)
    seq_lens = torch.tensor([c + n for c, n in reqs], dtype=torch.int32)
    step_slots = [s for (cached, _), req in zip(reqs, slots, strict=True)
                  for s in req[cached:]]
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq_lens, seq_lens_cpu=seq_lens,
        block_table=torch.tensor(rows, dtype=torch.int32),
        slot_mapping=torch.tensor(step_slots, dtype=torch.int64), num_reqs=len(reqs),
        num_actual_tokens=query_start[-1], max_query_len=max(qlens),
        max_seq_len=int(seq_lens.max()),
    )
    q, k, v = torch.cat(queries), torch.cat(keys), torch.cat(values)
    out = torch.full_like(q, float("nan"))
    _impl(backend, spec, scale, params).forward(q, k, v, cache, _build(backend, spec, common),
                                                out)
    return StepResult(q, out, contexts, query_start)


def _impl(backend: type[AttentionBackend], spec: AttentionSpec, scale: float,
          params: dict[str, Any] | None) -> Any:
    return backend.get_impl_cls()(AttentionImplParams(spec=spec, layer_name="layer",
                                                      scale=scale, **(params or {})))


def _build(backend: type[AttentionBackend], spec: AttentionSpec,
           common: CommonAttentionMetadata) -> Any:
    ctx = AttentionContext(plugin_name=backend.name, process="worker", spec=spec,
                           layer_names=("layer",), device="cpu", max_num_reqs=64,
                           max_num_batched_tokens=1024, max_model_len=1024)
    return backend.get_builder_cls()(ctx).build(common)


def _write(backend: type[AttentionBackend], spec: AttentionSpec, scale: float,
           cache: torch.Tensor, slots: list[int], keys: torch.Tensor, values: torch.Tensor,
           params: dict[str, Any] | None) -> None:
    """Store ``keys``/``values`` at ``slots``: a step of one-token requests, output dropped."""
    n = len(slots)
    block = spec.block_size
    table = torch.tensor([[s // block] for s in slots], dtype=torch.int32)
    qsl = torch.arange(n + 1, dtype=torch.int32)
    seq_lens = torch.tensor([s % block + 1 for s in slots], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq_lens, seq_lens_cpu=seq_lens,
        block_table=table, slot_mapping=torch.tensor(slots, dtype=torch.int64), num_reqs=n,
        num_actual_tokens=n, max_query_len=1, max_seq_len=int(seq_lens.max()))
    query = torch.zeros(n, spec.num_heads, spec.head_size, dtype=keys.dtype)
    _impl(backend, spec, scale, params).forward(query, keys, values, cache,
                                                _build(backend, spec, common),
                                                torch.empty_like(query))


def reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
              scale: float, *, window: int | None = None, soft_cap: float | None = None,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of queries at positions ``start..`` over keys ``0..pos``, in float32.

    One query at a time: the scores ``q k^T * scale``, capped to ``soft_cap * tanh(s /
    soft_cap)``, the last ``window`` keys, and per head a sink logit concatenated to the
    scores before the softmax and dropped after (transformers' GPT-OSS eager attention).
    """
    heads, kv_heads = query.shape[1], keys.shape[1]
    out = []
    for i in range(query.shape[0]):
        pos = start + i
        lo = 0 if window is None else max(0, pos - window + 1)
        k = keys[lo:pos + 1].float().repeat_interleave(heads // kv_heads, dim=1)
        v = values[lo:pos + 1].float().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", query[i].float(), k) * scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        if sinks is not None:
            scores = torch.cat([scores, sinks.float()[:, None]], dim=1)
        probs = scores.softmax(-1)
        if sinks is not None:
            probs = probs[:, :-1]
        out.append(torch.einsum("hn,nhd->hd", probs, v))
    return torch.stack(out)


def check_step(result: StepResult, scale: float, *, window: int | None = None,
               soft_cap: float | None = None, sinks: torch.Tensor | None = None,
               tol: float = 1e-5) -> None:
    """Assert the backend's output equals :func:`reference` for every request."""
    for i, (keys, values, cached) in enumerate(result.contexts):
        lo, hi = result.query_start[i], result.query_start[i + 1]
        expected = reference(result.query[lo:hi], keys, values, cached, scale, window=window,
                             soft_cap=soft_cap, sinks=sinks)
        torch.testing.assert_close(result.output[lo:hi].float(), expected, atol=tol, rtol=tol,
                                   msg=lambda m, i=i: f"request {i}: {m}")


__all__ = ["EQUAL_DECODES", "MIXED", "StepResult", "check_step", "reference", "run_step"]
