"""Conformance suite for ``AttentionBackend`` plugins: run it against your own backend.

:func:`check_attention_backend` drives your backend through the SDK interface only (its
builder and one impl per layer, over KV caches shaped by your ``get_kv_cache_shape``), the
way the engine's worker does, and compares every output row with dense attention over
the keys and values the suite generated (``engine.testing.contracts._attention_sim``).
Each case is a head geometry, block size and sliding window (and, in
:data:`SPEC_OPTION_CASES`, the logit soft cap and attention sinks of SDK 1.1); each runs
five steps on two layers over one shuffled block pool::

    stale blocks      every usable block filled by short prompts of large, offset values,
                      then freed: later requests reuse blocks whose unused tail is stale
    prompts           full prompts (one ends mid-block, one a single token), and a first
                      chunk ending exactly on a block boundary
    mixed             a new prompt, decodes, a second chunk over the cached prefix, a decode
                      ending exactly on a block boundary, in no particular order
    decode            every request one token (a uniform decode batch)
    reused blocks     a third chunk across a block boundary, a new prompt in a finished
                      request's blocks, a decode

Steps have padding rows past ``num_actual_tokens`` (slots in the null block, large
values), outputs start as NaN, and ``query``/``key``/``value`` are strided views of one
fused tensor. A case your ``supports`` turns down is skipped and reported with the reason;
assert ``not report.skipped`` to require all of them.

Usage, in the backend's own tests (pytest)::

    from engine.testing.contracts import check_attention_backend
    from my_plugin.attention import MyBackend


    def test_my_backend_conforms() -> None:
        report = check_attention_backend(MyBackend, device="cuda", dtype="bfloat16")
        assert not report.skipped, report.skipped

A backend listing ``logits_soft_cap`` or ``has_sinks`` in ``answered_spec_fields`` runs
:data:`SPEC_OPTION_CASES` too (``cases=SPEC_OPTION_CASES``); a backend that does not list
them has those cases skipped, the engine's reason reported.

.. versionadded:: 1.1
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.sdk.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionSpec,
    CudaGraphSupport,
    backend_supports,
)
from engine.sdk.platform import PlatformInfo
from engine.sdk.plugin import PluginOptions, check_contract_version
from engine.testing.contexts import plugin_options
from engine.testing.contracts._attention_sim import AttentionSim, RowCheck

__all__ = ["DEFAULT_ATTENTION_CASES", "SPEC_OPTION_CASES", "AttentionBackendReport",
           "AttentionCase", "check_attention_backend"]


@dataclass(frozen=True)
class AttentionCase:
    """One layer geometry the suite runs (every field becomes the ``AttentionSpec``'s).

    Attributes:
        name: Shown in messages and the report.
        num_heads: Query heads.
        num_kv_heads: Key/value heads (``num_heads / num_kv_heads`` is the GQA ratio).
        head_size: Elements per head.
        block_size: Tokens per KV block.
        sliding_window: Keys each query sees, itself included; ``None`` for all.
        logits_soft_cap: ``AttentionSpec.logits_soft_cap``: scores capped to ``cap *
            tanh(score / cap)``; ``None`` for none.
        sinks: ``AttentionSpec.has_sinks``: each layer gets random per-head sink logits
            (``AttentionImplParams.sinks``) that join the softmax's denominator.
    """

    name: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    sinks: bool = False


#: GQA ratios 1, 3 and 4; head sizes 64 and 128; block sizes 8, 16, 32; two windows.
DEFAULT_ATTENTION_CASES: tuple[AttentionCase, ...] = (
    AttentionCase("mha, head 64, block 16", 2, 2, 64, 16),
    AttentionCase("gqa 3, head 128, block 16", 6, 2, 128, 16),
    AttentionCase("gqa 4, head 64, block 32, window 35", 8, 2, 64, 32, sliding_window=35),
    AttentionCase("gqa 4, head 128, block 8, window 11", 4, 1, 128, 8, sliding_window=11),
)

#: The spec options of SDK 1.1 (caps small enough to change the scores a lot, sinks
#: alone, both with a window): pass ``cases=SPEC_OPTION_CASES`` for a backend listing them.
SPEC_OPTION_CASES: tuple[AttentionCase, ...] = (
    AttentionCase("gqa 2, head 64, block 16, soft cap 2", 4, 2, 64, 16, logits_soft_cap=2.0),
    AttentionCase("mha, head 64, block 16, sinks", 2, 2, 64, 16, sinks=True),
    AttentionCase("gqa 4, head 128, block 8, window 11, soft cap 3, sinks", 4, 1, 128, 8,
                  sliding_window=11, logits_soft_cap=3.0, sinks=True),
)

#: ``(atol, rtol)`` per dtype: an output element passes when ``|out - ref| <= atol +
#: rtol * |ref|`` (float64 reference).
TOLERANCES: Mapping[str, tuple[float, float]] = {
    "float32": (1e-4, 1e-4), "float16": (4e-3, 4e-3), "bfloat16": (1.5e-2, 2e-2)}


@dataclass(frozen=True)
class AttentionBackendReport:
    """What a passing :func:`check_attention_backend` run covered.

    Attributes:
        cases: The cases run.
        skipped: ``(case, reason)`` for each case ``supports`` turned down.
        num_steps: Steps run (each on every layer).
        num_rows: Output rows compared (all layers).
        max_abs_error: Largest ``|out - reference|`` seen.
    """

    cases: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...]
    num_steps: int
    num_rows: int
    max_abs_error: float


def _steps(bs: int) -> list[tuple[str, list[tuple[str, int]], int]]:
    """``(step, [(request, new tokens)], padding rows)`` after the stale-blocks step."""
    return [
        ("prompts", [("a", 2 * bs - 3 if bs > 3 else 2 * bs), ("b", 2 * bs), ("c", 1),
                     ("d", 2 * bs - 1)], 2),
        ("mixed", [("e", 3), ("a", 1), ("b", 5), ("c", 1), ("d", 1)], 3),
        ("decode", [("d", 1), ("a", 1), ("b", 1), ("c", 1), ("e", 1)], 1),
        ("reused blocks", [("b", bs + 1), ("f", bs + 2), ("c", 1)], 0),
    ]


#: Requests that finish after a step (their blocks go back to the pool).
_FINISHED_AFTER = {"decode": ("a",)}


def _pool_size(bs: int) -> tuple[int, int]:
    """``(usable blocks, most blocks one request holds)`` the steps need at their peak."""
    lengths: dict[str, int] = {}
    peak = longest = 0
    for step, batch, _ in _steps(bs):
        for name, num_new in batch:
            lengths[name] = lengths.get(name, 0) + num_new
        blocks = {name: math.ceil(n / bs) for name, n in lengths.items()}
        peak = max(peak, sum(blocks.values()))
        longest = max(longest, *blocks.values())
        for name in _FINISHED_AFTER.get(step, ()):
            del lengths[name]
    return peak, longest


def _compare(case: str, step: str, layer: int, out: torch.Tensor, ref: torch.Tensor,
             rows: list[RowCheck], tolerance: tuple[float, float]) -> float:
    atol, rtol = tolerance
    error = (out.double() - ref).abs()
    bad = ~(error <= atol + rtol * ref.abs())  # NaN (a row never written) is bad too
    if bad.any():
        token, head, _ = (int(i) for i in bad.nonzero()[0])
        row = next(r for r in rows if r.start <= token < r.start + r.num_tokens)
        raise AssertionError(
            f"{case}: step {step!r}, layer {layer}, {row.describe()}: output row "
            f"{token} (its query {token - row.start}), head {head} differs from dense "
            f"attention: max |out - reference| = {error[bad].max().item():.3g} "
            f"(allowed {atol:g} + {rtol:g} * |reference|); {int(bad.sum())} elements bad")
    return float(error.max()) if error.numel() else 0.0


def _check_classes(backend: type[AttentionBackend]) -> None:
    assert isinstance(backend, type) and issubclass(backend, AttentionBackend), (
        f"{backend!r} is not a subclass of engine.sdk.attention.AttentionBackend")
    missing = sorted(getattr(backend, "__abstractmethods__", ()))
    assert not missing, (f"{backend.__qualname__} leaves abstract methods unimplemented: "
                         f"{', '.join(missing)}")
    support = check_contract_version(backend)
    assert support, f"{backend.__qualname__}: {support.reason}"
    assert isinstance(backend.cudagraph_support, CudaGraphSupport), (
        f"{backend.__qualname__}.cudagraph_support must be a CudaGraphSupport, got "
        f"{backend.cudagraph_support!r}")
    for method, base in (("get_builder_cls", AttentionMetadataBuilder),
                         ("get_impl_cls", AttentionImpl)):
        cls = getattr(backend, method)()
        assert isinstance(cls, type) and issubclass(cls, base) and not inspect.isabstract(cls), (
            f"{backend.__qualname__}.{method}() must return a concrete subclass of "
            f"engine.sdk.attention.{base.__qualname__}, got {cls!r}")


def _check_shape(backend: type[AttentionBackend], case: AttentionCase) -> None:
    args = (case.block_size, case.num_kv_heads, case.head_size)
    one = backend.get_kv_cache_shape(1, *args)
    seven = backend.get_kv_cache_shape(7, *args)
    where = f"{backend.__qualname__}.get_kv_cache_shape"
    assert all(isinstance(n, int) and n > 0 for n in (*one, *seven)), (
        f"{where} must return positive ints, got {one} and {seven}")
    assert math.prod(seven) == 7 * math.prod(one), (
        f"{where}: 7 blocks ({seven}) must hold 7 times the elements of one ({one})")
    assert math.prod(one) >= 2 * math.prod(args), (
        f"{where}: one block ({one}) cannot hold keys and values of {case.block_size} "
        f"tokens x {case.num_kv_heads} heads x {case.head_size}")
    assert backend.get_kv_cache_shape(7, *args) == seven, f"{where} must be a pure function"


def _run_case(backend: type[AttentionBackend], case: AttentionCase, spec: AttentionSpec,
              device: str, options: PluginOptions, seed: int) -> tuple[int, int, float]:
    bs = case.block_size
    usable, longest = _pool_size(bs)
    sim = AttentionSim(backend, spec, num_blocks=usable + 1, max_blocks_per_req=longest + 1,
                       num_layers=2, device=device, options=options, seed=seed)
    tolerance = TOLERANCES.get(spec.dtype, TOLERANCES["bfloat16"])
    stale = [(f"stale-{i}", bs) for i in range(usable)]
    schedule = [("stale blocks", stale, 0), *_steps(bs)]
    num_rows, max_error = 0, 0.0
    for step, batch, padding in schedule:
        outputs, references, rows = sim.step(batch, num_padding=padding,
                                             junk=step == "stale blocks")
        for layer, (out, ref) in enumerate(zip(outputs, references, strict=True)):
            max_error = max(max_error, _compare(case.name, step, layer, out, ref, rows,
                                                tolerance))
            num_rows += out.shape[0]
        finished = [name for name, _ in stale] if step == "stale blocks" else \
            _FINISHED_AFTER.get(step, ())
        for name in finished:
            sim.finish(name)
    return len(schedule), num_rows, max_error


def _dtype_name(dtype: str | torch.dtype) -> str:
    """``dtype`` as the spec spells it: ``torch.bfloat16`` -> ``"bfloat16"``."""
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    if not isinstance(dtype, str):
        raise TypeError(f"check_attention_backend: dtype must be a dtype name such as "
                        f"'bfloat16' or a torch.dtype such as torch.bfloat16, got {dtype!r}")
    return dtype


def check_attention_backend(
    backend: type[AttentionBackend], *, device: str = "cpu",
    dtype: str | torch.dtype = "float32",
    cases: Sequence[AttentionCase] = DEFAULT_ATTENTION_CASES, platform: PlatformInfo | None = None,
    options: Mapping[str, Any] | PluginOptions | None = None, seed: int = 0,
) -> AttentionBackendReport:
    """Run every case (see the module docstring) against ``backend``.

    Checked first: the class is a concrete ``AttentionBackend`` of this SDK's major
    version, ``cudagraph_support`` is a ``CudaGraphSupport``, the builder and impl classes
    are concrete subclasses of the SDK's, ``supports`` returns a ``Support``, and
    ``get_kv_cache_shape`` is pure and holds ``num_blocks`` times one block. Then, per
    case, every output row of every step and layer against dense attention, and that
    ``forward`` returns the ``output`` it was given.

    Args:
        backend: The backend class (what your entry point names).
        device: Where the step's tensors and the KV caches live, e.g. ``"cuda"``.
        dtype: ``spec.dtype`` and ``spec.kv_cache_dtype`` of every case: a name
            (``"bfloat16"``) or a ``torch.dtype`` (``torch.bfloat16``), which the specs
            carry by name as the engine's do.
        cases: The geometries (default :data:`DEFAULT_ATTENTION_CASES`).
        platform: ``spec.platform`` (default: a ``PlatformInfo`` of ``device``'s type).
        options: The backend's options (a mapping validated by ``backend.Options``, or an
            instance).
        seed: Seed of the generated values and of the block shuffling.

    Returns:
        What the run covered, the skipped cases with ``supports``'s reasons included.

    Raises:
        AssertionError: naming the case, step, layer, request and row that is wrong, or
            the rule the class breaks; also when ``supports`` turns down every case.
        TypeError: ``dtype`` is neither a name nor a ``torch.dtype``.
    """
    dtype_name = _dtype_name(dtype)
    _check_classes(backend)
    if platform is None:
        device_type = torch.device(device).type
        platform = PlatformInfo(name=device_type, device_type=device_type,
                                supported_dtypes=(dtype_name,))
    validated = plugin_options(backend, options)
    run, skipped = [], []
    num_steps = num_rows = 0
    max_error = 0.0
    for case in cases:
        spec = AttentionSpec(num_heads=case.num_heads, num_kv_heads=case.num_kv_heads,
                             head_size=case.head_size, dtype=dtype_name, kv_cache_dtype=dtype_name,
                             block_size=case.block_size, sliding_window=case.sliding_window,
                             platform=platform, logits_soft_cap=case.logits_soft_cap,
                             has_sinks=case.sinks)
        try:  # as the engine asks: the spec fields added since 1.0 first, then supports()
            answer = backend_supports(backend, spec)
        except TypeError as exc:
            raise AssertionError(str(exc)) from None
        if not answer.ok:
            skipped.append((case.name, answer.reason))
            continue
        _check_shape(backend, case)
        steps, rows, error = _run_case(backend, case, spec, device, validated, seed)
        run.append(case.name)
        num_steps, num_rows = num_steps + steps, num_rows + rows
        max_error = max(max_error, error)
    assert run, (f"{backend.__qualname__}.supports() turned down every case: " + "; ".join(
        f"{name}: {reason}" for name, reason in skipped))
    return AttentionBackendReport(tuple(run), tuple(skipped), num_steps, num_rows, max_error)
