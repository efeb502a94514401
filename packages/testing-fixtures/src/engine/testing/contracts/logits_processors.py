"""Conformance suite for ``LogitsProcessor`` plugins: run it against your own class.

:func:`check_logits_processor` drives the processor the way the engine's worker does, on
a simulated persistent batch with long random churn (arrivals, finishes, preemptions and
resumptions, condensing moves, reordering swaps), and compares every logits row with a
*slot-free* reference you write: ``reference(params, prompt_token_ids, output_token_ids,
row) -> row``, the result one request should get, knowing nothing about slots. The
typical bug it catches is request A's parameters applied to request B's row after a slot
was reused or moved.

Usage, in the plugin's own test suite (pytest)::

    import random

    from engine.sdk.sampling_params import SamplingParams
    from engine.testing.contracts import check_logits_processor
    from my_pkg.processors import BanTokens


    def make_params(rng: random.Random) -> SamplingParams:
        if rng.random() < 0.5:
            return SamplingParams()  # requests that do not use the processor
        return SamplingParams(extra_args={"ban_tokens": rng.sample(range(64), 3)})


    def reference(params, prompt_token_ids, output_token_ids, row):
        for token_id in (params.extra_args or {}).get("ban_tokens", ()):
            row[token_id] = float("-inf")
        return row


    def test_ban_tokens_conforms() -> None:
        check_logits_processor(BanTokens, make_params, reference=reference)

The default vocabulary has 64 tokens (``BatchSimConfig(vocab_size=...)`` to change it).
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from engine.sdk.errors import ValidationError
from engine.sdk.logits_processor import LogitsProcessor, LogitsProcessorContext
from engine.sdk.plugin import PluginOptions, check_contract_version
from engine.sdk.sampling_params import SamplingParams
from engine.testing.contexts import plugin_options
from engine.testing.contracts._batch_sim import BatchSimConfig, BatchSimulator, SimStats

__all__ = ["ConformanceReport", "ReferenceFn", "check_logits_processor"]

#: ``reference(params, prompt_token_ids, output_token_ids, row) -> row``: the logits one
#: request should get. ``row`` is a private copy of the request's input row (modify it
#: freely); ``output_token_ids`` is a copy of the tokens generated before this step.
ReferenceFn = Callable[
    [SamplingParams, tuple[int, ...] | None, list[int], torch.Tensor], torch.Tensor
]

_RTOL, _ATOL = 1.3e-6, 1e-5
A = TypeVar("A")
R = TypeVar("R")


@dataclass(frozen=True)
class ConformanceReport:
    """What a passing :func:`check_logits_processor` run covered.

    Attributes:
        num_rows_checked: Logits rows compared with the reference.
        num_rows_changed: Rows the reference changed (requests using the processor).
        num_applies_skipped: Steps where ``apply`` was skipped, as the engine does for an
            argmax-invariant processor when every request is greedy.
        churn: The simulator's counters (requests, moves, swaps, batch sizes, ...).
    """

    num_rows_checked: int
    num_rows_changed: int
    num_applies_skipped: int
    churn: SimStats


def check_logits_processor(
    cls: type[LogitsProcessor],
    make_params: Callable[[random.Random], SamplingParams],
    *,
    reference: ReferenceFn,
    steps: int = 1000,
    seed: int = 0,
    sim: BatchSimConfig | None = None,
    options: Mapping[str, Any] | PluginOptions | None = None,
) -> ConformanceReport:
    """Check a logits processor against a slot-free reference under random batch churn.

    Checks, in order: ``cls`` is a concrete ``LogitsProcessor`` built for this SDK's major
    version; ``validate_params`` accepts every ``make_params`` result; then, for ``steps``
    steps: ``update_state`` then ``apply`` (skipped on some steps when the processor is
    argmax-invariant, as the engine does), the result has the input's shape, dtype and
    device, each row equals the reference's row (within float32 tolerance), an
    argmax-invariant processor kept every row's argmax, and no ``output_token_ids`` list
    was modified. Finally at least one row must have been changed by the reference, so a
    ``make_params`` that never uses the processor cannot pass vacuously.

    Args:
        cls: The processor class under test.
        make_params: Builds a new request's parameters from the simulator's random
            generator; mix requests that use the processor with requests that do not.
        reference: The expected row for one request (see :data:`ReferenceFn`).
        steps: Engine steps to simulate.
        seed: Seeds the churn and the logits; a failure message gives it to reproduce.
        sim: The workload shape (batch capacity, vocabulary size, churn rates).
        options: The processor's options: values by key (validated against
            ``cls.Options``, as the engine does; since 1.1) or an ``Options`` instance;
            default ``cls.Options()``.

    Returns:
        Coverage counters, for tests that want to assert on them.

    Raises:
        AssertionError: The processor broke its contract; the message names the step,
            slot, request and its parameters, and the last batch update.
    """
    config = sim or BatchSimConfig()
    _check_class(cls)
    ctx = LogitsProcessorContext(
        plugin_name=cls.__qualname__, options=plugin_options(cls, options), device="cpu",
        max_num_reqs=config.max_num_reqs, vocab_size=config.vocab_size,
    )
    proc = cls(ctx)
    invariant = proc.is_argmax_invariant()
    if not isinstance(invariant, bool):
        raise AssertionError(f"{cls.__qualname__}.is_argmax_invariant() returned "
                             f"{invariant!r}, not a bool")

    def validated_params(rng: random.Random) -> SamplingParams:
        params = make_params(rng)
        try:
            cls.validate_params(params)
        except ValidationError as exc:
            raise AssertionError(f"{cls.__qualname__}.validate_params rejected parameters "
                                 f"make_params built: {params!r}: {exc}") from exc
        return params

    simulator = BatchSimulator(validated_params, seed=seed, config=config)
    generator = torch.Generator().manual_seed(seed)
    checked = changed = skipped = 0
    for step in range(steps):
        update = simulator.next_update()
        _call(cls, simulator, step, seed, proc.update_state, update)
        _check_outputs_untouched(cls, simulator, step)
        if invariant and simulator.rng.random() < 0.2:
            skipped += 1
        else:
            logits = torch.randn(simulator.batch_size, config.vocab_size, generator=generator)
            out = _call(cls, simulator, step, seed, proc.apply, logits.clone())
            _check_outputs_untouched(cls, simulator, step)
            changed += _check_step(cls, simulator, step, seed, logits, out, reference,
                                   invariant)
            checked += simulator.batch_size
        simulator.sample()
    if checked and not changed:
        raise AssertionError(
            f"the check of {cls.__qualname__} proved nothing: in {steps} steps the reference "
            f"never changed a row; make_params must build requests that use the processor"
        )
    return ConformanceReport(checked, changed, skipped, simulator.stats)


def _check_class(cls: type[LogitsProcessor]) -> None:
    if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
        raise AssertionError(f"{cls!r} is not a subclass of engine.sdk.logits_processor."
                             f"LogitsProcessor")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))
        raise AssertionError(f"{cls.__qualname__} leaves abstract methods unimplemented: "
                             f"{missing}")
    support = check_contract_version(cls)
    if not support:
        raise AssertionError(f"{cls.__qualname__}: {support.reason}")


def _call(cls: type[LogitsProcessor], simulator: BatchSimulator, step: int, seed: int,
          method: Callable[[A], R], arg: A) -> R:
    """Run one processor call; an exception becomes an AssertionError with the context."""
    try:
        return method(arg)
    except Exception as exc:
        raise AssertionError(
            f"{cls.__qualname__}.{method.__name__} raised at step {step} (seed={seed}): {exc!r}\n"
            f"  last batch update: {simulator.last_update_summary}\n"
            f"  batch (slot order): {[r.req_id for r in simulator.slots]}"
        ) from exc


def _check_step(
    cls: type[LogitsProcessor],
    simulator: BatchSimulator,
    step: int,
    seed: int,
    logits: torch.Tensor,
    out: torch.Tensor,
    reference: ReferenceFn,
    invariant: bool,
) -> int:
    """Compare one step's output with the reference; returns the rows the reference changed."""
    where = f"{cls.__qualname__}.apply at step {step} (seed={seed})"
    if not isinstance(out, torch.Tensor):
        raise AssertionError(f"{where} returned {type(out).__name__}, not a torch.Tensor")
    if out.shape != logits.shape or out.dtype != logits.dtype or out.device != logits.device:
        raise AssertionError(
            f"{where} returned shape {tuple(out.shape)} {out.dtype} on {out.device}; expected "
            f"{tuple(logits.shape)} {logits.dtype} on {logits.device}"
        )
    slots = simulator.slots
    expected = torch.stack([
        reference(req.params, req.prompt_token_ids, list(req.expected_output_ids),
                  logits[slot].clone())
        for slot, req in enumerate(slots)
    ])
    ok = torch.isclose(out, expected, rtol=_RTOL, atol=_ATOL, equal_nan=True).all(dim=1)
    if not bool(ok.all()):
        slot = int((~ok).nonzero()[0])
        req = slots[slot]
        bad = (~torch.isclose(out[slot], expected[slot], rtol=_RTOL, atol=_ATOL,
                              equal_nan=True)).nonzero().flatten()[:8].tolist()
        raise AssertionError(
            f"{where}: slot {slot} (logits row {slot}) holds request {req.req_id}, whose "
            f"row differs from the reference at token ids {bad}: expected "
            f"{expected[slot][bad].tolist()}, got {out[slot][bad].tolist()}\n"
            f"  request params: {req.params!r}\n"
            f"  prompt_token_ids: {req.prompt_token_ids}, output_token_ids: "
            f"{req.expected_output_ids}\n"
            f"  last batch update: {simulator.last_update_summary}\n"
            f"  batch (slot order): {[r.req_id for r in slots]}"
        )
    if invariant:
        top = logits.argmax(dim=1, keepdim=True)
        lost = (out.gather(1, top).squeeze(1) < out.amax(dim=1)).nonzero().flatten()
        if lost.numel():
            slot = int(lost[0])
            raise AssertionError(
                f"{where}: is_argmax_invariant() is True but token {int(top[slot])}, the "
                f"argmax of slot {slot} (request {slots[slot].req_id}, params "
                f"{slots[slot].params!r}), is no longer the largest logit"
            )
    return int((expected != logits).any(dim=1).sum())


def _check_outputs_untouched(cls: type[LogitsProcessor], simulator: BatchSimulator,
                             step: int) -> None:
    for req in simulator.slots:
        if req.output_token_ids != req.expected_output_ids:
            raise AssertionError(
                f"{cls.__qualname__} modified output_token_ids of request {req.req_id} at "
                f"step {step}: it is {req.output_token_ids}, the engine wrote "
                f"{req.expected_output_ids}; processors must only read it"
            )
