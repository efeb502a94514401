"""Tests of the logits-processor contract, its helpers and its conformance suite.

The churn tests compare what a processor sees through ``BatchUpdate``s with the ground
truth of a simulated persistent batch (``engine.testing.contracts.BatchSimulator``); the
reference side never sees a slot, so "request A's parameter applied to request B's row"
shows up as a mismatch. Deliberately broken processors prove the checks can fail.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import random
import re
import subprocess
import sys
from typing import Any

import pytest
import torch

from engine.sdk import __version__
from engine.sdk.context import PluginContext
from engine.sdk.errors import PluginError, ValidationError
from engine.sdk.logits_processor import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessorContext,
    MoveDirectionality,
    MovedRequest,
    PerRequestLogitsProcessor,
    RequestLogitsProcessor,
    process_dict_updates,
)
from engine.sdk.sampling_params import SamplingParams
from engine.testing.contracts import (
    BatchSimConfig,
    BatchSimulator,
    check_logits_processor,
)

MOVE, SWAP = MoveDirectionality.MOVE, MoveDirectionality.SWAP
VOCAB = BatchSimConfig().vocab_size


def ctx(**overrides: Any) -> LogitsProcessorContext:
    values: dict[str, Any] = {"max_num_reqs": 8, "vocab_size": VOCAB}
    values.update(overrides)
    return LogitsProcessorContext(**values)


def added(index: int, tag: int | None = None, output: list[int] | None = None) -> AddedRequest:
    extra = None if tag is None else {"tag": tag}
    return AddedRequest(index, SamplingParams(extra_args=extra), (1, 2), output or [])


def tag_of(params: SamplingParams, *_: object) -> int | None:
    value = (params.extra_args or {}).get("tag")
    return value if isinstance(value, int) else None


# --------------------------------------------------------------------------- example plugins
# A per-request bias: extra_args {"bias": [token_id, value]}; the effect also depends on the
# number of generated tokens (live list) and, for the 3-arg flavour, on the prompt.


def make_bias_params(rng: random.Random) -> SamplingParams:
    if rng.random() < 0.4:
        return SamplingParams(temperature=rng.choice((0.0, 0.7)))
    return SamplingParams(extra_args={"bias": [rng.randrange(VOCAB), rng.uniform(5, 20)]})


def bias_reference(params: SamplingParams, prompt: tuple[int, ...] | None,
                   output: list[int], row: torch.Tensor) -> torch.Tensor:
    bias = (params.extra_args or {}).get("bias")
    if bias is not None:
        row[bias[0]] += bias[1] + len(output)
    return row


def prompt_reference(params: SamplingParams, prompt: tuple[int, ...] | None,
                     output: list[int], row: torch.Tensor) -> torch.Tensor:
    bias = (params.extra_args or {}).get("bias")
    if bias is not None:
        row[bias[0]] += bias[1] + len(output) - (len(prompt) if prompt is not None else 100)
    return row


class BiasPerRequest(PerRequestLogitsProcessor):
    """2-argument functions."""

    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        bias = (params.extra_args or {}).get("bias")
        if bias is None:
            return None
        token, value = bias

        def fn(output_ids: list[int], row: torch.Tensor) -> torch.Tensor:
            row[token] += value + len(output_ids)
            return row

        return fn


class PromptBiasPerRequest(PerRequestLogitsProcessor):
    """3-argument functions that return a new tensor instead of modifying in place."""

    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        bias = (params.extra_args or {}).get("bias")
        if bias is None:
            return None
        token, value = bias

        def fn(prompt: tuple[int, ...] | None, output_ids: list[int],
               row: torch.Tensor) -> torch.Tensor:
            out = row.clone()
            out[token] += value + len(output_ids) - (len(prompt) if prompt is not None else 100)
            return out

        return fn


class BiasBatch(LogitsProcessor):
    """Batch-level version with process_dict_updates and a dense per-slot cache."""

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        bias = (params.extra_args or {}).get("bias")
        if bias is not None and not (isinstance(bias, list) and len(bias) == 2):
            raise ValidationError("bias must be [token_id, value]", param="extra_args.bias")

    def __init__(self, ctx: LogitsProcessorContext) -> None:
        super().__init__(ctx)
        self.slot_to_state: dict[int, tuple[int, float, list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.slot_to_state, batch_update, self._new_state)

    @staticmethod
    def _new_state(params: SamplingParams, prompt: tuple[int, ...] | None,
                   output: list[int]) -> tuple[int, float, list[int]] | None:
        bias = (params.extra_args or {}).get("bias")
        return None if bias is None else (bias[0], bias[1], output)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for slot, (token, value, output) in self.slot_to_state.items():
            logits[slot, token] += value + len(output)
        return logits


# ------------------------------------------------------------------------ contract basics


def test_incomplete_subclasses_cannot_be_instantiated() -> None:
    class NoApply(LogitsProcessor):
        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update: BatchUpdate | None) -> None:
            pass

    class NoFactory(PerRequestLogitsProcessor):
        pass

    with pytest.raises(TypeError, match="apply"):
        NoApply(ctx())  # type: ignore[abstract]
    with pytest.raises(TypeError, match="new_req_logits_processor"):
        NoFactory(ctx())  # type: ignore[abstract]
    with pytest.raises(TypeError):
        LogitsProcessor(ctx())  # type: ignore[abstract]


def test_sdk_version_is_recorded_on_subclasses() -> None:
    class Pinned(BiasBatch):
        sdk_version = "1.0.0"

    assert BiasBatch.sdk_version == __version__
    assert BiasPerRequest.sdk_version == __version__
    assert Pinned.sdk_version == "1.0.0"


def test_batch_update_types_are_frozen() -> None:
    update = BatchUpdate(batch_size=1, added=(added(0),), moved=(MovedRequest(0, 1, MOVE),))
    with pytest.raises(dataclasses.FrozenInstanceError):
        update.batch_size = 2  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        update.added[0].index = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        update.moved[0].to_index = 3  # type: ignore[misc]
    assert BatchUpdate(batch_size=0) == BatchUpdate(0, (), (), ())


def test_context_is_a_frozen_keyword_only_plugin_context() -> None:
    context = ctx(device="cuda:0", is_pin_memory=True)
    assert isinstance(context, PluginContext)
    assert (context.device, context.max_num_reqs, context.is_pin_memory) == ("cuda:0", 8, True)
    assert context.eos_token_id is None and ctx(eos_token_id=2).eos_token_id == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        context.vocab_size = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        LogitsProcessorContext("p", max_num_reqs=1, vocab_size=1)  # type: ignore[call-arg]
    for bad in ({"vocab_size": 0}, {"max_num_reqs": True}, {"max_num_reqs": 2.0}):
        with pytest.raises(ValueError, match="must be an int >= 1"):
            ctx(**bad)


def test_validate_params_defaults_to_accepting_everything() -> None:
    BiasPerRequest.validate_params(SamplingParams(extra_args={"anything": object()}))
    with pytest.raises(ValidationError) as info:
        BiasBatch.validate_params(SamplingParams(extra_args={"bias": 3}))
    assert info.value.param == "extra_args.bias"


def test_importing_the_contract_does_not_import_torch() -> None:
    code = ("import sys, engine.sdk.logits_processor, engine.sdk.groups as g; "
            "assert 'torch' not in sys.modules, 'torch was imported'; "
            "m, _, c = g.GROUPS[g.LOGITS_PROCESSORS].contract.partition(':'); "
            "assert getattr(sys.modules[m], c) is engine.sdk.logits_processor.LogitsProcessor")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


# ------------------------------------------------------------ process_dict_updates, by hand


def test_process_dict_updates_none_changes_nothing() -> None:
    state = {0: 5}
    assert process_dict_updates(state, None, tag_of) is False
    assert state == {0: 5}


@pytest.mark.parametrize(
    ("before", "update", "after", "changed"),
    [
        # removed, including a slot without state
        ({0: 1, 1: 2}, BatchUpdate(1, removed=(1, 5)), {0: 1}, True),
        ({0: 1}, BatchUpdate(1, removed=(3,)), {0: 1}, False),
        # removed then added into the same slot: the new state survives
        ({1: 2}, BatchUpdate(2, removed=(1,), added=(added(1, 9),)), {1: 9}, True),
        # added into a slot still holding (stale) state: replaced, or cleared on None
        ({1: 2}, BatchUpdate(2, added=(added(1, 9),)), {1: 9}, True),
        ({1: 2}, BatchUpdate(2, added=(added(1),)), {}, True),
        # added requests that do not use the processor change nothing
        ({0: 1}, BatchUpdate(3, added=(added(1), added(2))), {0: 1}, False),
        # SWAP: both sides, one side (either), neither
        ({0: 1, 1: 2}, BatchUpdate(2, moved=(MovedRequest(0, 1, SWAP),)), {0: 2, 1: 1}, True),
        ({0: 1}, BatchUpdate(2, moved=(MovedRequest(0, 1, SWAP),)), {1: 1}, True),
        ({1: 2}, BatchUpdate(2, moved=(MovedRequest(0, 1, SWAP),)), {0: 2}, True),
        ({5: 5}, BatchUpdate(2, moved=(MovedRequest(0, 1, SWAP),)), {5: 5}, False),
        # MOVE onto an occupied slot overwrites it; MOVE from an empty slot clears the target
        ({0: 1, 1: 2}, BatchUpdate(1, moved=(MovedRequest(1, 0, MOVE),)), {0: 2}, True),
        ({0: 1}, BatchUpdate(1, moved=(MovedRequest(1, 0, MOVE),)), {}, True),
        ({0: 1}, BatchUpdate(1, moved=(MovedRequest(0, 0, MOVE),)), {0: 1}, False),
        # moves apply in order: 0->2 then 2<->1
        ({0: 1, 1: 2}, BatchUpdate(3, moved=(MovedRequest(0, 2, MOVE),
                                             MovedRequest(2, 1, SWAP))), {1: 1, 2: 2}, True),
        # the module docstring's diagram: A B C D, B and C leave, E arrives at 1, D 3->2
        ({0: 10, 1: 11, 2: 12, 3: 13},
         BatchUpdate(3, removed=(1, 2), added=(added(1, 14),),
                     moved=(MovedRequest(3, 2, MOVE),)),
         {0: 10, 1: 14, 2: 13}, True),
    ],
)
def test_process_dict_updates_edge_cases(before: dict[int, int], update: BatchUpdate,
                                         after: dict[int, int], changed: bool) -> None:
    state = dict(before)
    assert process_dict_updates(state, update, tag_of) is changed
    assert state == after


def test_process_dict_updates_keeps_falsy_states() -> None:
    state: dict[int, int] = {}
    update = BatchUpdate(2, added=(added(0, 0),), moved=(MovedRequest(0, 1, MOVE),))
    assert process_dict_updates(state, update, tag_of) is True
    assert state == {1: 0}
    assert process_dict_updates(state, BatchUpdate(1, removed=(1,)), tag_of) is True
    assert state == {}


def test_process_dict_updates_passes_the_live_output_list() -> None:
    output = [7]
    seen: list[list[int]] = []
    process_dict_updates({}, BatchUpdate(1, added=(added(0, 1, output),)),
                         lambda params, prompt, out: seen.append(out))
    assert seen[0] is output


# ------------------------------------------------------------------- the churn simulator


def replay(slots: dict[int, int], update: BatchUpdate | None) -> None:
    """Naive, list-free application of an update to slot -> id(output list)."""
    if update is None:
        return
    for index in update.removed:
        slots.pop(index, None)  # may be a slot that held nothing
    for req in update.added:
        assert req.index not in slots, "added into a slot that is still occupied"
        slots[req.index] = id(req.output_token_ids)
    for move in update.moved:
        src, dst = slots.pop(move.from_index, None), slots.pop(move.to_index, None)
        if src is not None:
            slots[move.to_index] = src
        if dst is not None and move.directionality is SWAP:
            slots[move.from_index] = dst
        assert move.directionality is SWAP or dst is None, "MOVE onto a running request"


@pytest.mark.parametrize("seed", [0, 1])
def test_simulator_updates_are_well_formed_and_cover_the_edge_cases(seed: int) -> None:
    config = BatchSimConfig(max_num_reqs=12)
    sim = BatchSimulator(make_bias_params, seed=seed, config=config)
    slots: dict[int, int] = {}
    for _ in range(3000):
        update = sim.next_update()
        if update is not None:
            assert len(set(update.removed)) == len(update.removed)
            assert update.batch_size == sim.batch_size
        replay(slots, update)
        assert slots == {i: id(r.output_token_ids) for i, r in enumerate(sim.slots)}
        assert all(0 <= i < config.max_num_reqs for i in slots)
        sim.sample()
    stats = sim.stats
    assert (stats.min_batch_size, stats.max_batch_size) == (1, config.max_num_reqs)
    for counter in ("num_reused_slots", "num_resumed", "num_moves", "num_swaps",
                    "num_added_then_moved", "num_unchanged_steps", "num_ghost_removals"):
        assert getattr(stats, counter) > 50, counter


# ------------------------------------------------------------- process_dict_updates, churn


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_process_dict_updates_under_churn_matches_a_slot_free_model(seed: int) -> None:
    next_tag = iter(range(1, 1 << 30))
    req_to_tag: dict[str, int | None] = {}  # request id -> its tag, kept by the test

    def make_params(rng: random.Random) -> SamplingParams:
        if rng.random() < 0.35:
            return SamplingParams()
        return SamplingParams(extra_args={"tag": next(next_tag)})

    sim = BatchSimulator(make_params, seed=seed, config=BatchSimConfig(max_num_reqs=10))
    state: dict[int, int] = {}
    for step in range(4000):
        before = dict(state)
        changed = process_dict_updates(state, sim.next_update(), tag_of)
        expected = {}
        for slot, req in enumerate(sim.slots):
            tag = req_to_tag.setdefault(req.req_id, tag_of(req.params))
            if tag is not None:
                expected[slot] = tag
        assert state == expected, f"step {step}: {sim.last_update_summary}"
        assert changed or state == before
        sim.sample()


# ---------------------------------------------------- PerRequestLogitsProcessor, churn


@pytest.mark.parametrize(("cls", "reference"), [(BiasPerRequest, bias_reference),
                                               (PromptBiasPerRequest, prompt_reference),
                                               (BiasBatch, bias_reference)])
@pytest.mark.parametrize("seed", [0, 1])
def test_processors_match_the_reference_under_long_churn(
        cls: type[LogitsProcessor], reference: Any, seed: int) -> None:
    report = check_logits_processor(cls, make_bias_params, reference=reference, steps=3000,
                                    seed=seed)
    assert report.num_rows_changed > 1000
    assert report.num_rows_checked - report.num_rows_changed > 1000  # selectivity
    assert report.churn.num_swaps > 100 and report.churn.num_moves > 100


def test_new_req_logits_processor_is_called_once_per_added_request() -> None:
    calls: list[SamplingParams] = []

    class Counting(BiasPerRequest):
        def new_req_logits_processor(self, params: SamplingParams) -> Any:
            calls.append(params)
            return super().new_req_logits_processor(params)

    report = check_logits_processor(Counting, make_bias_params, reference=bias_reference,
                                    steps=500)
    assert len(calls) == report.churn.num_added


class _Scale:
    def __call__(self, output_ids: list[int], row: torch.Tensor) -> torch.Tensor:
        return row * 2


def _three(k: int, prompt: Any, output_ids: list[int], row: torch.Tensor) -> torch.Tensor:
    return row + k


def _with_default(output_ids: list[int], row: torch.Tensor, k: float = 1.0) -> torch.Tensor:
    return row + k


def _prompt_varargs(*args: Any) -> torch.Tensor:
    prompt, _, row = args
    result: torch.Tensor = row + (0 if prompt is None else len(prompt))
    return result


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        (_Scale(), lambda prompt, row: row * 2),
        (functools.partial(_three, 5), lambda prompt, row: row + 5),
        (_with_default, lambda prompt, row: row + 1),
        (_prompt_varargs, lambda prompt, row: row + (0 if prompt is None else len(prompt))),
    ],
)
def test_request_function_arity_is_detected(fn: Any, expected: Any) -> None:
    class Fixed(PerRequestLogitsProcessor):
        def new_req_logits_processor(self, params: SamplingParams) -> Any:
            return fn if (params.extra_args or {}).get("on") else None

    def make_params(rng: random.Random) -> SamplingParams:
        return SamplingParams(extra_args={"on": rng.random() < 0.5})

    def reference(params: SamplingParams, prompt: Any, output: Any, row: Any) -> Any:
        return expected(prompt, row) if (params.extra_args or {}).get("on") else row

    check_logits_processor(Fixed, make_params, reference=reference, steps=300)


@pytest.mark.parametrize(
    ("fn", "reason"),
    [
        (42, "not callable"),
        (lambda a, b, c, d: a, "4 required positional"),
        (lambda row: row, "not 2 or 3"),
        (lambda out, row, *, k: row, "keyword-only"),
    ],
)
def test_unusable_request_functions_raise_plugin_error(fn: Any, reason: str) -> None:
    class Bad(PerRequestLogitsProcessor):
        def new_req_logits_processor(self, params: SamplingParams) -> Any:
            return fn

    proc = Bad(ctx(plugin_name="bad_proc"))
    with pytest.raises(PluginError, match=reason) as info:
        proc.update_state(BatchUpdate(1, added=(added(0),)))
    assert "bad_proc" in str(info.value) and "new_req_logits_processor" in str(info.value)


def test_per_request_apply_touches_only_using_rows() -> None:
    proc = BiasPerRequest(ctx())
    output = [1, 2]
    user = AddedRequest(1, SamplingParams(extra_args={"bias": [3, 1.0]}), None, output)
    proc.update_state(BatchUpdate(2, added=(added(0), user)))
    logits = torch.zeros(2, VOCAB)
    out = proc.apply(logits)
    assert out is logits
    assert out[0].count_nonzero() == 0 and out[1, 3] == 3.0 and out[1].count_nonzero() == 1
    output.append(5)  # the engine grows the live list: the function sees it
    proc.update_state(None)
    assert proc.apply(torch.zeros(2, VOCAB))[1, 3] == 4.0


# --------------------------------------------------- the conformance suite catches bugs


class _BuggyBias(BiasBatch):
    """BiasBatch whose update_state is replaced by a broken one in each subclass."""


class IgnoresMoves(_BuggyBias):
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is not None:
            process_dict_updates(self.slot_to_state, dataclasses.replace(batch_update, moved=()),
                                 self._new_state)


class SwapAsMove(_BuggyBias):
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is not None:
            moved = tuple(MovedRequest(m.from_index, m.to_index, MOVE)
                          for m in batch_update.moved)
            batch_update = dataclasses.replace(batch_update, moved=moved)
        process_dict_updates(self.slot_to_state, batch_update, self._new_state)


class IgnoresRemoved(_BuggyBias):
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is not None:
            for req in batch_update.added:  # only records users: stale state survives
                if (state := self._new_state(req.params, None, req.output_token_ids)):
                    self.slot_to_state[req.index] = state
            process_dict_updates(self.slot_to_state, dataclasses.replace(
                batch_update, removed=(), added=()), self._new_state)


class AddedBeforeRemoved(_BuggyBias):
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is not None:
            first = dataclasses.replace(batch_update, removed=(), moved=())
            process_dict_updates(self.slot_to_state, first, self._new_state)
            process_dict_updates(self.slot_to_state, dataclasses.replace(
                batch_update, added=()), self._new_state)


class SnapshotsOutputIds(_BuggyBias):
    """Copies output_token_ids instead of keeping the live list."""

    @staticmethod
    def _new_state(params: SamplingParams, prompt: tuple[int, ...] | None,
                   output: list[int]) -> tuple[int, float, list[int]] | None:
        return BiasBatch._new_state(params, prompt, list(output))


class WritesOutputIds(_BuggyBias):
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for _, _, output in self.slot_to_state.values():
            output.append(0)
        return super().apply(logits)


class ClaimsArgmaxInvariant(_BuggyBias):
    def is_argmax_invariant(self) -> bool:
        return True


class ClosureOverLastParams(PerRequestLogitsProcessor):
    """The classic closure bug: every function reads the most recent request's bias."""

    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        bias = (params.extra_args or {}).get("bias")
        if bias is None:
            return None
        self.last = bias

        def fn(output_ids: list[int], row: torch.Tensor) -> torch.Tensor:
            row[self.last[0]] += self.last[1] + len(output_ids)
            return row

        return fn


@pytest.mark.parametrize(
    ("cls", "message"),
    [
        (IgnoresMoves, "differs from the reference|apply raised"),
        (SwapAsMove, "differs from the reference"),
        (IgnoresRemoved, "differs from the reference|apply raised"),
        (AddedBeforeRemoved, "differs from the reference"),
        (SnapshotsOutputIds, "differs from the reference"),
        (WritesOutputIds, "modified output_token_ids"),
        (ClaimsArgmaxInvariant, "is no longer the largest logit"),
        (ClosureOverLastParams, "differs from the reference"),
    ],
)
def test_the_conformance_suite_catches_broken_processors(cls: type[LogitsProcessor],
                                                         message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        check_logits_processor(cls, make_bias_params, reference=bias_reference, steps=2000)


def test_a_mismatch_names_step_slot_request_and_params() -> None:
    with pytest.raises(AssertionError) as info:
        check_logits_processor(ClosureOverLastParams, make_bias_params,
                               reference=bias_reference, seed=3)
    text = str(info.value)
    for needle in ("ClosureOverLastParams.apply at step ", "(seed=3)", "slot ", "request req-",
                   "request params: SamplingParams(", "last batch update: batch_size="):
        assert needle in text


def test_an_exception_in_the_processor_is_reported_with_its_context() -> None:
    with pytest.raises(AssertionError) as info:
        check_logits_processor(IgnoresMoves, make_bias_params, reference=bias_reference,
                               seed=3)
    text = str(info.value)
    assert re.search(r"IgnoresMoves\.apply raised at step \d+ \(seed=3\): IndexError\(", text)
    assert "last batch update: batch_size=" in text and "batch (slot order): ['req-" in text
    assert isinstance(info.value.__cause__, IndexError)


def test_the_suite_refuses_a_vacuous_run() -> None:
    with pytest.raises(AssertionError, match="proved nothing"):
        check_logits_processor(BiasBatch, lambda rng: SamplingParams(),
                               reference=bias_reference, steps=50)


def test_the_suite_checks_the_class_and_validate_params() -> None:
    class Old(BiasBatch):
        sdk_version = "0.9.0"

    class Incomplete(LogitsProcessor):
        pass

    with pytest.raises(AssertionError, match="not a subclass"):
        check_logits_processor(object, make_bias_params,  # type: ignore[arg-type]
                               reference=bias_reference)
    with pytest.raises(AssertionError, match="abstract methods unimplemented: apply"):
        check_logits_processor(Incomplete, make_bias_params,  # type: ignore[type-abstract]
                               reference=bias_reference)
    with pytest.raises(AssertionError, match="0.9.0"):
        check_logits_processor(Old, make_bias_params, reference=bias_reference)
    with pytest.raises(AssertionError, match="validate_params rejected"):
        check_logits_processor(BiasBatch, lambda rng: SamplingParams(extra_args={"bias": 1}),
                               reference=bias_reference)


# ------------------------------------------------------- argmax-invariant processors


class KeepTopK(LogitsProcessor):
    """extra_args {"keep_top": k}: every logit outside the row's top k becomes -inf."""

    def __init__(self, ctx: LogitsProcessorContext) -> None:
        super().__init__(ctx)
        self.slot_to_k: dict[int, int] = {}
        self.num_applies = 0

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.slot_to_k, batch_update,
                             lambda params, _p, _o: (params.extra_args or {}).get("keep_top"))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        self.num_applies += 1
        for slot, k in self.slot_to_k.items():
            kth = logits[slot].topk(k).values[-1]
            logits[slot][logits[slot] < kth] = float("-inf")
        return logits


def keep_top_reference(params: SamplingParams, prompt: Any, output: Any,
                       row: torch.Tensor) -> torch.Tensor:
    k = (params.extra_args or {}).get("keep_top")
    if k is None:
        return row
    return torch.where(row >= row.topk(k).values[-1], row, torch.tensor(float("-inf")))


def test_an_argmax_invariant_processor_passes_with_skipped_applies() -> None:
    def make_params(rng: random.Random) -> SamplingParams:
        keep = rng.choice((None, 1, 5, 20))
        return SamplingParams(extra_args=None if keep is None else {"keep_top": keep})

    report = check_logits_processor(KeepTopK, make_params, reference=keep_top_reference,
                                    steps=1500)
    assert report.num_applies_skipped > 100
