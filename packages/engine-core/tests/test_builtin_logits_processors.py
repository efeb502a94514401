"""Tests of the built-in logits processors: min_tokens, logit_bias, min_p.

Each passes the published conformance suite (random batch churn against a slot-free
reference), and is checked end to end through ``InputBatch`` and ``Sampler`` with
requests that use it mixed with requests that do not.
"""

from __future__ import annotations

import math
import random
from importlib.metadata import entry_points

import numpy as np
import torch

from engine.core.logits_processors import (
    BUILTIN_LOGITS_PROCESSORS,
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)
from engine.core.sample import Sampler
from engine.core.worker.input_batch import CachedRequestState, InputBatch
from engine.sdk.groups import LOGITS_PROCESSORS
from engine.sdk.logits_processor import LogitsProcessorContext
from engine.sdk.sampling_params import SamplingParams
from engine.testing.contracts import BatchSimConfig, check_logits_processor

VOCAB = BatchSimConfig().vocab_size
EOS = 0
STEPS = 300


def make_ctx(max_num_reqs: int = 8, eos_token_id: int | None = EOS) -> LogitsProcessorContext:
    return LogitsProcessorContext(max_num_reqs=max_num_reqs, vocab_size=VOCAB,
                                  eos_token_id=eos_token_id)


def test_builtins_are_registered_entry_points() -> None:
    found = {ep.name: ep.load() for ep in entry_points(group=LOGITS_PROCESSORS)
             if ep.value.startswith("engine.core.")}
    assert found == {"min_tokens": MinTokensLogitsProcessor,
                     "logit_bias": LogitBiasLogitsProcessor, "min_p": MinPLogitsProcessor}
    assert set(BUILTIN_LOGITS_PROCESSORS) == set(found.values())
    assert [cls(make_ctx()).is_argmax_invariant() for cls in BUILTIN_LOGITS_PROCESSORS] == [
        False, False, True]


# -- conformance under churn ------------------------------------------------------------


def min_tokens_params(rng: random.Random) -> SamplingParams:
    if rng.random() < 0.4:
        return SamplingParams()
    return SamplingParams(min_tokens=rng.randint(1, 6), max_tokens=16,
                          stop_token_ids=tuple(rng.sample(range(VOCAB + 4), 2)))


def min_tokens_reference(params: SamplingParams, prompt: object, output: list[int],
                         row: torch.Tensor) -> torch.Tensor:
    if len(output) < params.min_tokens:
        for token in params.stop_token_ids:
            if token < VOCAB:
                row[token] = float("-inf")
    return row


def test_min_tokens_conforms() -> None:
    report = check_logits_processor(MinTokensLogitsProcessor, min_tokens_params,
                                    reference=min_tokens_reference, steps=STEPS)
    assert report.num_rows_changed > 0 and report.churn.num_moves > 0


def logit_bias_params(rng: random.Random) -> SamplingParams:
    if rng.random() < 0.4:
        return SamplingParams()
    tokens = rng.sample(range(VOCAB + 4), rng.randint(1, 4))  # some beyond the vocabulary
    return SamplingParams(logit_bias={t: rng.uniform(-100, 100) for t in tokens})


def logit_bias_reference(params: SamplingParams, prompt: object, output: list[int],
                         row: torch.Tensor) -> torch.Tensor:
    for token, bias in (params.logit_bias or {}).items():
        if token < VOCAB:
            row[token] += bias
    return row


def test_logit_bias_conforms() -> None:
    report = check_logits_processor(LogitBiasLogitsProcessor, logit_bias_params,
                                    reference=logit_bias_reference, steps=STEPS)
    assert report.num_rows_changed > 0


def min_p_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(min_p=rng.choice([0.0, 0.0, 0.05, 0.2, 0.6]))


def min_p_reference(params: SamplingParams, prompt: object, output: list[int],
                    row: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(row, dim=0)
    row[probs < params.min_p * probs.max()] = float("-inf")
    return row


def test_min_p_conforms() -> None:
    report = check_logits_processor(MinPLogitsProcessor, min_p_params,
                                    reference=min_p_reference, steps=STEPS)
    assert report.num_rows_changed > 0 and report.num_applies_skipped > 0


# -- end to end through the batch and the sampler ----------------------------------------


def run_greedy(params: list[SamplingParams], logits: torch.Tensor, steps: int,
               outputs: list[list[int]] | None = None) -> list[list[int]]:
    """Sample ``steps`` tokens greedily from fixed ``logits``; return each request's tokens."""
    ctx = make_ctx(max_num_reqs=len(params))
    batch = InputBatch(len(params), 64, 4, VOCAB, "cpu",
                       [cls(ctx) for cls in BUILTIN_LOGITS_PROCESSORS])
    states = []
    for i, p in enumerate(params):
        state = CachedRequestState(f"r{i}", (1, 2), p,
                                   output_token_ids=list(outputs[i]) if outputs else [])
        batch.add_request(state)
        states.append(state)
    batch.commit_batch_update()
    for _ in range(steps):
        metadata = batch.make_sampling_metadata(np.zeros(batch.num_reqs, dtype=bool))
        sampled = Sampler()(logits.clone(), metadata).sampled_token_ids
        batch.append_tokens(np.arange(batch.num_reqs), sampled.numpy())
        batch.commit_batch_update()
    return [s.output_token_ids for s in states]


def test_min_tokens_blocks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(4, VOCAB)
    logits[:, EOS] = 10.0  # EOS is every row's favourite ...
    logits[:, 5] = 9.0  # ... then the stop token 5 ...
    logits[:, 7] = 8.0  # ... then 7
    params = [
        SamplingParams(temperature=0.0, min_tokens=3),
        SamplingParams(temperature=0.0),  # no minimum: untouched
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(5,)),
        SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True),
    ]
    out = run_greedy(params, logits, steps=4)
    assert out[0] == [5, 5, 5, EOS]
    assert out[1] == [EOS] * 4
    assert out[2] == [7, 7, EOS, EOS]
    assert out[3] == [EOS] * 4  # EOS is not a stop token when ignored


def test_min_tokens_counts_tokens_generated_before_a_preemption() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, EOS] = 10.0
    params = [SamplingParams(temperature=0.0, min_tokens=3)] * 2
    out = run_greedy(params, logits, steps=2, outputs=[[9, 9], [9, 9, 9]])
    # Request 0 had 2 of its 3 tokens: EOS stays blocked once (token 1 is the next best).
    assert out == [[9, 9, 1, EOS], [9, 9, 9, EOS, EOS]]


def test_min_tokens_without_eos_in_context_still_blocks_stop_ids() -> None:
    proc = MinTokensLogitsProcessor(make_ctx(eos_token_id=None))
    batch = InputBatch(2, 16, 2, VOCAB, "cpu", [proc])
    batch.add_request(CachedRequestState("a", (1,), SamplingParams(min_tokens=2,
                                                                   stop_token_ids=(3,))))
    batch.add_request(CachedRequestState("b", (1,), SamplingParams(min_tokens=2)))
    batch.commit_batch_update()
    out = proc.apply(torch.zeros(2, VOCAB))
    assert out[0, 3] == float("-inf") and out[0, EOS] == 0.0
    assert bool((out[1] == 0).all())


def test_logit_bias_applies_only_to_its_request() -> None:
    params = [SamplingParams(), SamplingParams(logit_bias={3: 5.0, VOCAB + 1: 1.0}),
              SamplingParams(), SamplingParams(logit_bias={3: -2.5, 0: 1.0})]
    proc = LogitBiasLogitsProcessor(make_ctx())
    batch = InputBatch(4, 16, 2, VOCAB, "cpu", [proc])
    for i, p in enumerate(params):
        batch.add_request(CachedRequestState(f"r{i}", (1,), p))
    batch.commit_batch_update()
    logits = torch.randn(4, VOCAB)
    out = proc.apply(logits.clone())
    expected = logits.clone()
    expected[1, 3] += 5.0
    expected[3, 3] -= 2.5
    expected[3, 0] += 1.0
    assert torch.equal(out, expected)
    # After request 1 leaves and request 3 moves into its slot, the bias follows it.
    batch.remove_request("r1")
    update = batch.commit_batch_update()
    assert update is not None and [(m.from_index, m.to_index) for m in update.moved] == [(3, 1)]
    out = proc.apply(logits[:3].clone())
    expected = logits[:3].clone()
    expected[1, 3] -= 2.5
    expected[1, 0] += 1.0
    assert torch.equal(out, expected)


def test_min_p_processor_only_touches_rows_that_use_it() -> None:
    proc = MinPLogitsProcessor(make_ctx())
    batch = InputBatch(3, 16, 2, VOCAB, "cpu", [proc])
    for i, min_p in enumerate([0.0, 0.3, 0.0]):
        batch.add_request(CachedRequestState(f"r{i}", (1,), SamplingParams(min_p=min_p)))
    batch.commit_batch_update()
    logits = torch.randn(3, VOCAB)
    out = proc.apply(logits.clone())
    assert torch.equal(out[[0, 2]], logits[[0, 2]])
    probs = torch.softmax(logits[1], dim=0)
    kept = probs >= 0.3 * probs.max()
    assert torch.equal(out[1][kept], logits[1][kept])
    assert bool(torch.isinf(out[1][~kept]).all()) and not math.isinf(float(out[1].max()))
