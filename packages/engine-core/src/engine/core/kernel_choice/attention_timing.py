"""Time attention backends on one layer spec at each step shape a worker runs.

Each row bucket (``buckets``) becomes a step: up to 64 rows, that many requests decoding
one token each after :data:`CONTEXT` tokens of context; above, one request's prompt chunk
of the bucket's rows. Every candidate gets its own KV cache in its own layout, filled with
the same keys and values through its own ``forward`` (a prefill of the context), then runs
the step: the metadata built from the step's layout, the layer's KV write and attention.
The candidates take turns, three rounds, each keeping its best round; one whose output
differs from the first candidate's (the platform's default) or that raises is left out
with the reason, and one far slower than the best after a round is not timed further.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.core.kernel_choice.buckets import RowBucket
from engine.core.kernel_choice.timing import (
    TOLERANCE,
    Timing,
    as_in_a_step,
    collect_timings,
    interleaved_rounds,
    relative_error,
)
from engine.core.plugin_faults import describe
from engine.sdk.attention import (
    AttentionBackend,
    AttentionContext,
    AttentionImplParams,
    AttentionSpec,
    CommonAttentionMetadata,
)
from engine.sdk.plugin import PluginOptions

#: Tokens each decoding request has in its KV cache (a short chat's worth).
CONTEXT = 256
#: Decode steps have at most this many requests; a bucket of more rows is a prompt chunk.
MAX_DECODES = 64
LAYER = "measured.attn"


@dataclass(frozen=True)
class _Step:
    """A step's batch layout: (cached tokens, new tokens) per request, and its metadata."""

    requests: tuple[tuple[int, int], ...]
    common: CommonAttentionMetadata


def step_requests(bucket: RowBucket, context: int = CONTEXT) -> tuple[tuple[int, int], ...]:
    """The requests of ``bucket``'s step: decodes after ``context`` tokens, or one chunk."""
    if bucket.rows <= MAX_DECODES:
        return ((context, 1),) * bucket.rows
    return ((0, bucket.rows),)


def _layout(requests: Sequence[tuple[int, int]], block_size: int) -> _Step:
    """Requests given consecutive blocks from 1 (0 is the null block), as the pool does."""
    rows, slots, next_block = [], [], 1
    width = max(math.ceil((c + n) / block_size) for c, n in requests)
    for cached, new in requests:
        count = math.ceil((cached + new) / block_size)
        blocks = list(range(next_block, next_block + count))
        next_block += count
        rows.append(blocks + [0] * (width - count))
        slots += [blocks[p // block_size] * block_size + p % block_size
                  for p in range(cached, cached + new)]
    qlens = torch.tensor([n for _, n in requests], dtype=torch.int32)
    starts = torch.cat([torch.zeros(1, dtype=torch.int32), qlens.cumsum(0).to(torch.int32)])
    seq_lens = torch.tensor([c + n for c, n in requests], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=starts, query_start_loc_cpu=starts, seq_lens=seq_lens,
        seq_lens_cpu=seq_lens, block_table=torch.tensor(rows, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64), num_reqs=len(requests),
        num_actual_tokens=int(starts[-1]), max_query_len=int(qlens.max()),
        max_seq_len=int(seq_lens.max()))
    return _Step(tuple(requests), common)


class _Runner:
    """One candidate on one step: its cache (context filled), metadata builder, layer."""

    def __init__(self, backend: type[AttentionBackend], options: PluginOptions,
                 spec: AttentionSpec, dtype: torch.dtype, step: _Step,
                 inputs: dict[str, torch.Tensor]) -> None:
        block = spec.block_size
        blocks = 1 + sum(math.ceil((c + n) / block) for c, n in step.requests)
        ctx = AttentionContext(spec=spec, layer_names=(LAYER,), device="cpu",
                               max_num_reqs=max(len(step.requests), 1),
                               max_num_batched_tokens=max(step.common.num_actual_tokens,
                                                          len(step.requests)),
                               max_model_len=max(c + n for c, n in step.requests))
        self.builder = backend.get_builder_cls()(ctx)
        self.impl = backend.get_impl_cls()(AttentionImplParams(
            spec=spec, layer_name=LAYER, scale=spec.head_size ** -0.5, options=options))
        shape = backend.get_kv_cache_shape(blocks, block, spec.num_kv_heads, spec.head_size)
        self.cache = torch.zeros(shape, dtype=dtype)
        self.step = step
        self.inputs = inputs
        self.out = torch.empty_like(inputs["query"])
        context = [(0, c) for c, _ in step.requests if c > 0]
        if context:  # the context's keys and values, written by the backend itself
            fill = _layout(context, block)
            self._forward(fill.common, inputs["context_query"], inputs["context_key"],
                          inputs["context_value"], torch.empty_like(inputs["context_query"]))

    def _forward(self, common: CommonAttentionMetadata, query: torch.Tensor,
                 key: torch.Tensor, value: torch.Tensor, out: torch.Tensor) -> None:
        metadata = self.builder.build(common)
        self.impl.forward(query, key, value, self.cache, metadata, out)

    def run(self) -> torch.Tensor:
        self._forward(self.step.common, self.inputs["query"], self.inputs["key"],
                      self.inputs["value"], self.out)
        return self.out


def _inputs(spec: AttentionSpec, dtype: torch.dtype, step: _Step) -> dict[str, torch.Tensor]:
    """Queries, keys and values of the step and of its context, the same for everyone."""
    generator = torch.Generator().manual_seed(0)
    tokens = step.common.num_actual_tokens
    context = sum(c for c, _ in step.requests)

    def rows(count: int, heads: int) -> torch.Tensor:
        return torch.randn(count, heads, spec.head_size, generator=generator).to(dtype)

    return {"query": rows(tokens, spec.num_heads), "key": rows(tokens, spec.num_kv_heads),
            "value": rows(tokens, spec.num_kv_heads),
            "context_query": rows(context, spec.num_heads),
            "context_key": rows(context, spec.num_kv_heads),
            "context_value": rows(context, spec.num_kv_heads)}


def _check(got: torch.Tensor, want: torch.Tensor, tolerance: float) -> None:
    error = relative_error(got, want)
    if not error <= tolerance:
        raise ValueError(f"its output differs from the first candidate's by {error:.3g} of "
                         f"the largest value (at most {tolerance:g} allowed)")


def time_backends(candidates: Sequence[tuple[str, type[AttentionBackend], PluginOptions]],
                  spec: AttentionSpec, dtype: torch.dtype, buckets: Sequence[RowBucket],
                  ) -> tuple[list[Timing], dict[str, str]]:
    """Each candidate's seconds per step in each bucket, and why each one left out was.

    ``candidates``: (name, class, options), the reference (the platform's default) first.
    """
    failed: dict[str, str] = {}
    rounds: list[dict[str, list[float]]] = []
    tolerance = TOLERANCE.get(spec.dtype, 3e-2)
    with as_in_a_step():
        for bucket in buckets:
            step = _layout(step_requests(bucket), spec.block_size)
            inputs = _inputs(spec, dtype, step)
            runners: dict[str, _Runner] = {}
            reference: torch.Tensor | None = None
            for name, backend, options in candidates:
                if name in failed:
                    continue
                try:
                    runner = _Runner(backend, options, spec, dtype, step, inputs)
                    out = runner.run().clone()
                    if reference is None:
                        reference = out
                    else:
                        _check(out, reference, tolerance)
                except Exception as exc:  # noqa: BLE001 - a plugin's failure leaves it out
                    failed[name] = describe(exc)
                    continue
                runners[name] = runner
            rounds.append(interleaved_rounds({n: r.run for n, r in runners.items()}))
    return collect_timings(rounds, [name for name, _, _ in candidates]), failed
