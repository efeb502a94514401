"""Tests of the persistent input batch: slots, buffers, BatchUpdates, sampling metadata.

The churn test drives ``InputBatch`` the way the model runner does (finish, preempt,
resume, arrive, grow, condense, commit, sample) and checks, every step, that what the
logits processors do to each row equals a *slot-free* reference computed from the
request alone: the bug class "request A's parameter applied to request B's logits".
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engine.core.logits_processors import BUILTIN_LOGITS_PROCESSORS
from engine.core.worker.input_batch import CachedRequestState, InputBatch
from engine.sdk.logits_processor import (
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessorContext,
    MoveDirectionality,
    process_dict_updates,
)
from engine.sdk.sampling_params import SamplingParams

VOCAB = 48
EOS = 1
NEG_INF = float("-inf")


def make_ctx(max_num_reqs: int) -> LogitsProcessorContext:
    return LogitsProcessorContext(max_num_reqs=max_num_reqs, vocab_size=VOCAB,
                                  eos_token_id=EOS)


class TagProcessor(LogitsProcessor):
    """Adds ``extra_args["tag"]`` to its request's row, and the output length to column 0."""

    def __init__(self, ctx: LogitsProcessorContext) -> None:
        super().__init__(ctx)
        self.slot_to_state: dict[int, tuple[float, list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.slot_to_state, batch_update, self._new_state)

    @staticmethod
    def _new_state(params: SamplingParams, prompt: object,
                   output: list[int]) -> tuple[float, list[int]] | None:
        tag = (params.extra_args or {}).get("tag")
        return None if tag is None else (float(tag), output)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for slot, (tag, output) in self.slot_to_state.items():
            logits[slot] += tag
            logits[slot, 0] += len(output)
        return logits


def reference_row(params: SamplingParams, output: list[int], row: torch.Tensor) -> torch.Tensor:
    """What the processors must do to one request's row, knowing nothing about slots."""
    if len(output) < params.min_tokens:
        for token in {*params.stop_token_ids, EOS}:
            row[token] = NEG_INF
    for token, bias in (params.logit_bias or {}).items():
        row[token] += bias
    tag = (params.extra_args or {}).get("tag")
    if tag is not None:
        row += float(tag)
        row[0] += len(output)
    if params.min_p > 0:
        probs = torch.softmax(row, dim=0)
        row[probs < params.min_p * probs.max()] = NEG_INF
    return row


def random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.0, 0.7, 1.0]),
        top_k=rng.choice([0, 0, 5]),
        top_p=rng.choice([1.0, 0.9]),
        min_p=rng.choice([0.0, 0.0, 0.1]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.5]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.3]),
        seed=rng.choice([None, rng.randrange(1000)]),
        min_tokens=rng.choice([0, 0, 3]),
        max_tokens=64,
        stop_token_ids=rng.choice([(), (rng.randrange(VOCAB),)]),
        logprobs=rng.choice([None, 0, 2]),
        logit_bias=rng.choice([None, {rng.randrange(VOCAB): rng.uniform(-5, 5)}]),
        extra_args=rng.choice([None, {"tag": rng.randint(1, 9)}]),
    )


def new_state(req_id: str, params: SamplingParams, rng: random.Random,
              output: list[int] | None = None) -> CachedRequestState:
    prompt = tuple(rng.randrange(VOCAB) for _ in range(rng.randint(1, 6)))
    generator = None
    if params.seed is not None and not params.is_greedy:
        generator = torch.Generator().manual_seed(params.seed)
    return CachedRequestState(req_id, prompt, params, output_token_ids=output or [],
                              block_ids=[rng.randrange(100) for _ in range(rng.randint(0, 2))],
                              generator=generator)


def check_buffers(batch: InputBatch) -> None:
    """Every slot's buffers describe the request the batch says is there."""
    assert sorted(batch.req_id_to_index.values()) == list(range(batch.num_reqs))
    sampling = batch.sampling
    for slot, req_id in enumerate(batch.req_ids):
        assert batch.req_id_to_index[req_id] == slot
        state = batch.get_request(req_id)
        tokens = list(state.prompt_token_ids) + state.output_token_ids
        assert batch.num_tokens[slot] == len(tokens)
        assert batch.num_prompt_tokens[slot] == len(state.prompt_token_ids)
        assert batch.token_ids_cpu[slot, : len(tokens)].tolist() == tokens
        assert batch.block_table[slot, : batch.num_blocks[slot]].tolist() == state.block_ids
        assert batch.num_computed_tokens[slot] == state.num_computed_tokens
        params = state.sampling_params
        assert bool(sampling.is_greedy[slot]) == params.is_greedy
        # Greedy rows hold neutral temperature and filters.
        neutral = params.replace(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
        expected = neutral if params.is_greedy else params
        assert float(sampling.temperature[slot]) == pytest.approx(expected.temperature)
        assert int(sampling.top_k[slot]) == expected.top_k
        assert float(sampling.top_p[slot]) == pytest.approx(expected.top_p)
        assert float(sampling.min_p[slot]) == pytest.approx(expected.min_p)
        assert float(sampling.repetition[slot]) == pytest.approx(params.repetition_penalty)
        assert float(sampling.frequency[slot]) == pytest.approx(params.frequency_penalty)


def test_churn_keeps_processor_state_with_its_request() -> None:
    rng = random.Random(0)
    max_num_reqs = 8
    ctx = make_ctx(max_num_reqs)
    processors = [cls(ctx) for cls in BUILTIN_LOGITS_PROCESSORS] + [TagProcessor(ctx)]
    batch = InputBatch(max_num_reqs, 128, 16, VOCAB, "cpu", processors)
    paused: list[CachedRequestState] = []
    logits_gen = torch.Generator().manual_seed(0)
    num_ids = num_moves = num_reused = num_resumed = 0
    for step in range(300):
        finish_prob = 0.5 if (step // 30) % 3 == 0 else 0.1
        removed = set()
        for req_id in list(batch.req_ids):
            draw = rng.random()
            if draw < finish_prob + 0.05:
                state = batch.get_request(req_id)
                removed.add(batch.remove_request(req_id))
                if draw >= finish_prob:
                    paused.append(state)
        for _ in range(rng.randint(0, 3)):
            if batch.num_reqs == max_num_reqs:
                break
            if paused and rng.random() < 0.5:  # resumed: a new state, as from NewRequestData
                old = paused.pop(rng.randrange(len(paused)))
                state = new_state(old.req_id, old.sampling_params, rng,
                                  output=list(old.output_token_ids))
                num_resumed += 1
            else:
                num_ids += 1
                state = new_state(f"req-{num_ids}", random_params(rng), rng)
            num_reused += batch.add_request(state) in removed
        for req_id in batch.req_ids:
            if rng.random() < 0.2:
                batch.append_block_ids(req_id, [rng.randrange(100)])
            batch.set_num_computed_tokens(req_id, rng.randrange(10))
        update = batch.commit_batch_update()
        num_moves += len(update.moved) if update else 0
        if batch.num_reqs == 0:
            continue
        check_buffers(batch)

        logits = torch.randn(batch.num_reqs, VOCAB, generator=logits_gen)
        out = logits.clone()
        for proc in processors:  # both call sites, in order: non-invariant, then min_p
            if not proc.is_argmax_invariant():
                out = proc.apply(out)
        for proc in processors:
            if proc.is_argmax_invariant():
                out = proc.apply(out)
        for slot, req_id in enumerate(batch.req_ids):
            state = batch.get_request(req_id)
            expected = reference_row(state.sampling_params, list(state.output_token_ids),
                                     logits[slot].clone())
            assert torch.allclose(out[slot], expected, atol=1e-5, equal_nan=True), (
                f"step {step}: slot {slot} ({req_id}, {state.sampling_params}) differs; "
                f"last update {update}")

        is_partial = np.array([rng.random() < 0.15 for _ in range(batch.num_reqs)])
        metadata = batch.make_sampling_metadata(is_partial)
        for req_id in batch.req_ids:  # each seeded request's generator is at its row
            state = batch.get_request(req_id)
            row = batch.req_id_to_index[req_id]
            assert metadata.generators.get(row) is state.generator
        rows = np.flatnonzero(~is_partial)
        batch.append_tokens(rows, np.array([rng.randrange(2, VOCAB) for _ in rows]))
    assert num_moves > 50 and num_reused > 20 and num_resumed > 10


def test_batch_update_matches_the_sdk_example() -> None:
    batch = InputBatch(4, 16, 2, VOCAB, "cpu", ())
    states = {name: CachedRequestState(name, (1, 2), SamplingParams()) for name in "ABCDE"}
    for name in "ABCD":
        batch.add_request(states[name])
    first = batch.commit_batch_update()
    assert first is not None and [a.index for a in first.added] == [0, 1, 2, 3]
    assert batch.commit_batch_update() is None  # nothing changed
    assert batch.remove_request("B") == 1 and batch.remove_request("C") == 2
    assert batch.remove_request("C") is None
    assert batch.add_request(states["E"]) == 1
    update = batch.commit_batch_update()
    assert update is not None
    assert update.batch_size == 3 and update.removed == (1, 2)
    assert [(a.index, a.output_token_ids is states["E"].output_token_ids)
            for a in update.added] == [(1, True)]
    assert [(m.from_index, m.to_index, m.directionality) for m in update.moved] == [
        (3, 2, MoveDirectionality.MOVE)]
    assert batch.req_ids == ["A", "E", "D"]


def test_added_then_removed_before_commit_is_never_announced() -> None:
    batch = InputBatch(2, 16, 2, VOCAB, "cpu", ())
    batch.add_request(CachedRequestState("a", (1,), SamplingParams()))
    batch.remove_request("a")
    update = batch.commit_batch_update()
    assert update is not None and update.added == () and update.batch_size == 0


def test_live_output_list_and_token_buffers() -> None:
    batch = InputBatch(2, 8, 2, VOCAB, "cpu", ())
    state = CachedRequestState("a", (5, 6), SamplingParams(), output_token_ids=[7])
    output = state.output_token_ids
    slot = batch.add_request(state)
    update = batch.commit_batch_update()
    assert update is not None and update.added[0].output_token_ids is output
    batch.append_token(slot, 9)
    batch.append_tokens([slot], [10])
    assert output == [7, 9, 10] and state.output_token_ids is output
    assert batch.token_ids_cpu[slot, :5].tolist() == [5, 6, 7, 9, 10]
    assert batch.num_tokens[slot] == 5 and batch.num_prompt_tokens[slot] == 2
    batch.append_tokens([slot] * 0, [])
    for token in range(3):
        batch.append_token(slot, token)
    with pytest.raises(ValueError, match="max_model_len"):
        batch.append_token(slot, 1)


def test_generator_moves_with_its_request() -> None:
    batch = InputBatch(4, 16, 2, VOCAB, "cpu", ())
    generators = {}
    for i in range(4):
        state = CachedRequestState(f"r{i}", (1,), SamplingParams(seed=i))
        state.generator = generators[i] = torch.Generator().manual_seed(i)
        batch.add_request(state)
    batch.commit_batch_update()
    batch.remove_request("r0")
    batch.remove_request("r1")
    batch.commit_batch_update()
    assert batch.req_ids == ["r3", "r2"]
    metadata = batch.make_sampling_metadata(np.zeros(2, dtype=bool))
    assert metadata.generators == {0: generators[3], 1: generators[2]}


def test_misuse_is_reported() -> None:
    batch = InputBatch(2, 4, 1, VOCAB, "cpu", ())
    batch.add_request(CachedRequestState("a", (1,), SamplingParams()))
    with pytest.raises(ValueError, match="already"):
        batch.add_request(CachedRequestState("a", (1,), SamplingParams()))
    with pytest.raises(ValueError, match="max_model_len"):
        batch.add_request(CachedRequestState("b", (1,) * 5, SamplingParams()))
    with pytest.raises(ValueError, match="blocks"):
        batch.add_request(CachedRequestState("b", (1,), SamplingParams(), block_ids=[1, 2]))
    with pytest.raises(RuntimeError, match="commit_batch_update"):
        batch.make_sampling_metadata(np.zeros(1, dtype=bool))
    batch.add_request(CachedRequestState("b", (1,), SamplingParams()))
    with pytest.raises(RuntimeError, match="full"):
        batch.add_request(CachedRequestState("c", (1,), SamplingParams()))
    batch.commit_batch_update()
    with pytest.raises(ValueError, match="shape"):
        batch.make_sampling_metadata(np.zeros(3, dtype=bool))
    with pytest.raises(ValueError, match="blocks"):
        batch.append_block_ids("a", [1, 2])
    batch.remove_request("a")
    batch.condense()
    with pytest.raises(RuntimeError, match="commit_batch_update"):
        batch.add_request(CachedRequestState("c", (1,), SamplingParams()))
    assert batch.commit_batch_update() is not None
