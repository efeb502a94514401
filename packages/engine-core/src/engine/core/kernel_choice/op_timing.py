"""Time a custom op's implementations on the model's shape at each row bucket.

Each built-in op has a workload made from the model's sizes: ``rms_norm`` of the hidden
size with a residual, ``silu_and_mul`` of the intermediate size, ``rotary_embedding`` of
the attention heads. Every implementation is built as the model builds it (same
arguments, the platform's dispatch key), checked against the contract's reference
(``forward_native`` on cloned inputs) and timed in turns, three rounds, best round; one
that raises or computes something else is left out with the reason.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

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
from engine.sdk.ops import BUILTIN_OPS, CustomOp, RotaryEmbeddingOp

#: Positions the rotary workload's cache covers.
MAX_POSITION = 4096
#: Calls per round: an op on a decode step takes microseconds.
OP_CALLS = 20


@dataclass(frozen=True)
class OpShape:
    """The model's sizes an op workload is made from."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype: str

    @classmethod
    def of(cls, hf_config: Any, dtype: torch.dtype) -> OpShape:
        """The sizes of a Llama-family config."""
        heads = hf_config.num_attention_heads
        return cls(hidden_size=hf_config.hidden_size,
                   intermediate_size=getattr(hf_config, "intermediate_size", 0) or 0,
                   num_heads=heads,
                   num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
                   head_size=getattr(hf_config, "head_dim", None)
                   or hf_config.hidden_size // heads,
                   dtype=str(dtype).removeprefix("torch."))


Build = Callable[[type[CustomOp], str], CustomOp]
Inputs = Callable[[int, torch.Generator], tuple[torch.Tensor, ...]]


def workload(op: str, shape: OpShape) -> tuple[Build, Inputs] | None:
    """How to build ``op`` and make its inputs for ``rows`` tokens; None: not measured."""
    dtype = getattr(torch, shape.dtype)

    def randn(generator: torch.Generator, *size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator).to(dtype)

    if op == "rms_norm":
        return (lambda cls, key: cls(shape.hidden_size, 1e-6, dtype=dtype, dispatch_key=key),
                lambda rows, g: (randn(g, rows, shape.hidden_size),
                                 randn(g, rows, shape.hidden_size)))
    if op == "silu_and_mul" and shape.intermediate_size:
        return (lambda cls, key: cls(dispatch_key=key),
                lambda rows, g: (randn(g, rows, 2 * shape.intermediate_size),))
    if op == "rotary_embedding":
        cache = RotaryEmbeddingOp.default_cos_sin_cache(shape.head_size, MAX_POSITION)
        return (lambda cls, key: cls(shape.head_size, shape.head_size, cache, True,
                                     dispatch_key=key),
                lambda rows, g: (torch.randint(0, MAX_POSITION, (rows,), generator=g),
                                 randn(g, rows, shape.num_heads, shape.head_size),
                                 randn(g, rows, shape.num_kv_heads, shape.head_size)))
    return None


def _flat(result: Any) -> list[torch.Tensor]:
    return list(result) if isinstance(result, tuple) else [result]


def _check(got: Any, want: Any, tolerance: float) -> None:
    got, want = _flat(got), _flat(want)
    if [tuple(g.shape) for g in got] != [tuple(w.shape) for w in want]:
        raise ValueError(f"its outputs are {[tuple(g.shape) for g in got]}, the reference's "
                         f"{[tuple(w.shape) for w in want]}")
    for g, w in zip(got, want, strict=True):
        error = relative_error(g, w)
        if not error <= tolerance:
            raise ValueError(f"its output differs from the reference (forward_native) by "
                             f"{error:.3g} of the largest value (at most {tolerance:g})")


def time_ops(op: str, candidates: Sequence[tuple[str, type[CustomOp]]], shape: OpShape,
             dispatch_key: str, buckets: Sequence[RowBucket],
             ) -> tuple[list[Timing], dict[str, str]] | None:
    """Each candidate's seconds per call in each bucket, and why each one left out was.

    None where ``op`` has no workload for this model (an op the engine does not measure).
    """
    made = workload(op, shape)
    if made is None:
        return None
    build, inputs = made
    reference = BUILTIN_OPS[op].forward_native  # the contract's, whatever a subclass says
    tolerance = TOLERANCE.get(shape.dtype, 3e-2)
    failed: dict[str, str] = {}
    built: dict[str, CustomOp] = {}
    rounds: list[dict[str, list[float]]] = []
    with as_in_a_step():
        for name, cls in candidates:
            try:
                built[name] = build(cls, dispatch_key)
            except Exception as exc:  # noqa: BLE001 - a plugin's failure leaves it out
                failed[name] = describe(exc)
        for bucket in buckets:
            args = inputs(bucket.rows, torch.Generator().manual_seed(bucket.rows))
            calls: dict[str, Callable[[], object]] = {}
            for name, instance in built.items():
                if name in failed:
                    continue
                try:
                    _check(instance(*(a.clone() for a in args)),
                           reference(instance, *(a.clone() for a in args)), tolerance)
                except Exception as exc:  # noqa: BLE001 - a plugin's failure leaves it out
                    failed[name] = describe(exc)
                    continue
                # in-place ops work on their own copy
                calls[name] = functools.partial(instance, *(a.clone() for a in args))
            rounds.append(interleaved_rounds(calls, repeats=OP_CALLS))
    return collect_timings(rounds, [name for name, _ in candidates]), failed
