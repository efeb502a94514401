"""Tests of the sampler: greedy, temperature, filters, penalties, seeds, logprobs.

Sampling metadata is built by a real ``InputBatch`` wherever the batch matters, so the
tests also cover ``make_sampling_metadata``. No test asserts on time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from engine.core.logits_processors import (
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
    apply_min_p,
)
from engine.core.sample import (
    LogprobsTensors,
    Sampler,
    SamplingMetadata,
    gather_logprobs,
    to_sample_logprobs,
)
from engine.core.sample.topk_topp import (
    apply_top_k_only,
    apply_top_k_top_p,
    top_k_top_p_candidates,
)
from engine.core.worker.input_batch import CachedRequestState, InputBatch
from engine.sdk.logits_processor import LogitsProcessor, LogitsProcessorContext
from engine.sdk.sampling_params import SamplingParams

VOCAB = 32
NEG_INF = float("-inf")


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.allclose(actual, expected, rtol=1e-5, atol=1e-5), (actual, expected)


def make_batch(
    params_list: Sequence[SamplingParams],
    *,
    processors: Sequence[LogitsProcessor] = (),
    prompts: Sequence[Sequence[int]] | None = None,
    outputs: Sequence[Sequence[int]] | None = None,
    req_ids: Sequence[str] | None = None,
) -> tuple[InputBatch, list[CachedRequestState]]:
    batch = InputBatch(max_num_reqs=max(len(params_list), 1), max_model_len=64,
                       max_num_blocks_per_req=4, vocab_size=VOCAB, device="cpu",
                       logits_processors=processors)
    states = []
    for i, params in enumerate(params_list):
        req_id = req_ids[i] if req_ids else f"r{i}"
        state = CachedRequestState(
            req_id=req_id, prompt_token_ids=tuple(prompts[i] if prompts else (1, 2, 3)),
            sampling_params=params, output_token_ids=list(outputs[i] if outputs else ()),
        )
        if params.seed is not None and not params.is_greedy:
            state.generator = torch.Generator().manual_seed(params.seed)
        batch.add_request(state)
        states.append(state)
    batch.commit_batch_update()
    return batch, states


def metadata_for(batch: InputBatch, partial: Sequence[bool] | None = None) -> SamplingMetadata:
    is_partial = np.zeros(batch.num_reqs, dtype=bool) if partial is None else np.array(partial)
    return batch.make_sampling_metadata(is_partial)


def builtin_processors(max_num_reqs: int = 8) -> list[LogitsProcessor]:
    ctx = LogitsProcessorContext(max_num_reqs=max_num_reqs, vocab_size=VOCAB)
    return [MinTokensLogitsProcessor(ctx), LogitBiasLogitsProcessor(ctx),
            MinPLogitsProcessor(ctx)]


def logits_for(key: int, step: int, scale: float = 3.0) -> torch.Tensor:
    """Deterministic logits of one request at one step, independent of the batch."""
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(key * 1000 + step)) * scale


# -- greedy ----------------------------------------------------------------------------


def test_all_greedy_is_argmax_and_builds_no_random_metadata() -> None:
    batch, _ = make_batch([SamplingParams(temperature=0.0, top_k=3, top_p=0.5)] * 4)
    metadata = metadata_for(batch)
    assert metadata.all_greedy and metadata.temperature is None
    assert metadata.penalties is None and metadata.max_num_logprobs is None
    logits = torch.randn(4, VOCAB)
    out = Sampler()(logits.clone(), metadata)
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=1))
    assert out.logprobs is None


def test_greedy_takes_the_first_of_equal_maxima_as_argmax_does() -> None:
    batch, _ = make_batch([SamplingParams(temperature=0.0)] * 4)
    logits = torch.randn(4, VOCAB)
    logits[0, [3, 7]] = 50.0  # a tie: the first
    logits[1] = 0.0  # a flat row: token 0
    logits[2, 5] = float("nan")  # a NaN wins, as in torch.argmax
    logits[3] = float("-inf")
    out = Sampler()(logits.clone(), metadata_for(batch))
    assert out.sampled_token_ids.tolist() == [3, 0, 5, 0]
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=1))


def test_greedy_rows_in_a_mixed_batch_take_the_argmax() -> None:
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=5.0, top_k=4),
              SamplingParams(temperature=0.0), SamplingParams(temperature=2.0)]
    batch, _ = make_batch(params)
    metadata = metadata_for(batch)
    assert not metadata.all_greedy and not metadata.all_random
    assert metadata.is_greedy is not None and metadata.is_greedy.tolist() == [
        True, False, True, False]
    logits = torch.randn(4, VOCAB)
    sampled = Sampler()(logits.clone(), metadata).sampled_token_ids
    assert sampled[0] == logits[0].argmax() and sampled[2] == logits[2].argmax()


class _Spy(LogitsProcessor):
    def __init__(self, ctx: LogitsProcessorContext, invariant: bool) -> None:
        super().__init__(ctx)
        self.invariant = invariant
        self.calls = 0

    def is_argmax_invariant(self) -> bool:
        return self.invariant

    def update_state(self, batch_update: object) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return logits


def test_all_greedy_batch_skips_argmax_invariant_processors_only() -> None:
    ctx = LogitsProcessorContext(max_num_reqs=2, vocab_size=VOCAB)
    invariant, non_invariant = _Spy(ctx, True), _Spy(ctx, False)
    batch, _ = make_batch([SamplingParams(temperature=0.0)] * 2,
                          processors=[invariant, non_invariant])
    Sampler()(torch.randn(2, VOCAB), metadata_for(batch))
    assert (invariant.calls, non_invariant.calls) == (0, 1)
    batch, _ = make_batch([SamplingParams(temperature=0.0), SamplingParams()],
                          processors=[invariant, non_invariant])
    Sampler()(torch.randn(2, VOCAB), metadata_for(batch))
    assert (invariant.calls, non_invariant.calls) == (1, 2)


# -- temperature distribution -----------------------------------------------------------


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_sampling_follows_softmax_of_scaled_logits(temperature: float) -> None:
    torch.manual_seed(1234)
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    num_rows = 20000
    metadata = SamplingMetadata(
        all_greedy=False, all_random=True,
        temperature=torch.full((num_rows,), temperature), is_greedy=None, top_k=None,
        top_p=None, min_p=None, penalties=None, generators={}, max_num_logprobs=None,
        is_partial=np.zeros(num_rows, dtype=bool),
    )
    sampled = Sampler()(base.repeat(num_rows, 1), metadata).sampled_token_ids
    counts = torch.bincount(sampled, minlength=5).double()
    probs = torch.softmax(base.double() / temperature, dim=0)
    # df = 4: P(chi2 > 18.47) = 0.001; the seed is fixed, so this is deterministic.
    assert _chi_square(counts, probs) < 18.47


def test_top_k_sampling_only_draws_kept_tokens_in_proportion() -> None:
    torch.manual_seed(7)
    base = torch.tensor([0.0, 3.0, 1.0, 2.5, -1.0])
    num_rows = 20000
    batch_params = SamplingParams(top_k=2)
    metadata = SamplingMetadata(
        all_greedy=False, all_random=True, temperature=None, is_greedy=None,
        top_k=torch.full((num_rows,), batch_params.top_k, dtype=torch.int64), top_p=None,
        min_p=None, penalties=None, generators={}, max_num_logprobs=None,
        is_partial=np.zeros(num_rows, dtype=bool),
    )
    sampled = Sampler()(base.repeat(num_rows, 1), metadata).sampled_token_ids
    counts = torch.bincount(sampled, minlength=5).double()
    assert set(torch.nonzero(counts).flatten().tolist()) == {1, 3}
    probs = torch.softmax(torch.tensor([3.0, 2.5], dtype=torch.float64), dim=0)
    assert _chi_square(counts[[1, 3]], probs) < 10.83  # df = 1, p = 0.001


# -- filters vs straightforward references ----------------------------------------------


def ref_top_k(row: list[float], k: int) -> list[float]:
    if k <= 0 or k >= len(row):
        return list(row)
    kth = sorted(row, reverse=True)[k - 1]
    return [x if x >= kth else NEG_INF for x in row]


def ref_top_p(row: list[float], p: float) -> list[float]:
    if p >= 1.0:
        return list(row)
    top = max(x for x in row)
    weights = [math.exp(x - top) for x in row]
    total = sum(weights)
    order = sorted(range(len(row)), key=lambda i: -row[i])
    keep, mass = set(), 0.0
    for i in order:  # keep the most likely tokens until their mass reaches p
        if mass >= p:
            break
        keep.add(i)
        mass += weights[i] / total
    return [x if i in keep else NEG_INF for i, x in enumerate(row)]


def ref_min_p(row: list[float], min_p: float) -> list[float]:
    top = max(row)
    return [x if math.exp(x - top) >= min_p else NEG_INF for x in row]


# Hand-made rows with distinct values and no probability mass near a cut.
ROWS = [
    [1.0, 4.0, 2.0, 3.0, 0.0, -2.0],
    [0.3, 0.2, 5.0, 0.1, 2.0, 1.9],
    [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0],
    [2.0, 2.5, 1.0, 6.0, 5.5, 0.0],
]


def test_top_k_mask_matches_reference() -> None:
    ks = [2, 0, 5, 6]  # 0 and vocab-size disable top-k
    logits = torch.tensor(ROWS)
    expected = torch.tensor([ref_top_k(r, k) for r, k in zip(ROWS, ks, strict=True)])
    k = torch.tensor(ks)
    assert torch.equal(apply_top_k_only(logits.clone(), k), expected)
    assert torch.equal(apply_top_k_top_p(logits.clone(), k, None), expected)
    assert torch.equal(apply_top_k_top_p(logits.clone(), k, torch.ones(4)), expected)


def test_top_p_mask_matches_reference() -> None:
    ps = [0.5, 0.9, 1.0, 0.3]
    logits = torch.tensor(ROWS)
    expected = torch.tensor([ref_top_p(r, p) for r, p in zip(ROWS, ps, strict=True)])
    assert torch.equal(apply_top_k_top_p(logits.clone(), None, torch.tensor(ps)), expected)


def test_top_k_then_top_p_matches_reference() -> None:
    ks, ps = [3, 2, 0, 4], [0.8, 0.99, 0.6, 1.0]
    logits = torch.tensor(ROWS)
    rows = []
    for row, k, p in zip(ROWS, ks, ps, strict=True):
        kept = ref_top_k(row, k)
        rows.append(ref_top_p(kept, p) if k else ref_top_p(row, p))
    out = apply_top_k_top_p(logits.clone(), torch.tensor(ks), torch.tensor(ps))
    assert torch.equal(out, torch.tensor(rows))


def sort_based_top_k_top_p(logits: torch.Tensor, k: torch.Tensor,
                           p: torch.Tensor) -> torch.Tensor:
    """vLLM's full-sort algorithm, in float64: the reference for the candidate search."""
    logits = logits.double()
    vocab = logits.shape[1]
    logits_sort, logits_idx = logits.sort(dim=1, descending=False)
    k_eff = torch.where((k > 0) & (k < vocab), k, vocab)
    kth = logits_sort.gather(1, (vocab - k_eff).unsqueeze(1))
    logits_sort.masked_fill_(logits_sort < kth, NEG_INF)
    probs_sum = logits_sort.softmax(dim=1).cumsum(dim=1)
    mask = probs_sum <= (1 - p.double()).unsqueeze(1)
    mask[:, -1] = False
    mask &= (p < 1).unsqueeze(1)
    logits_sort.masked_fill_(mask, NEG_INF)
    return logits_sort.scatter(1, logits_idx, logits_sort).float()


def test_top_p_candidate_search_matches_a_full_sort_on_flat_and_peaked_rows() -> None:
    gen = torch.Generator().manual_seed(5)
    vocab = 4000
    scales = torch.tensor([0.05, 0.3, 1.0, 4.0, 0.05, 2.0, 0.5, 8.0]).unsqueeze(1)
    logits = torch.randn(8, vocab, generator=gen) * scales  # flat rows need > 1024 tokens
    k = torch.tensor([0, 0, 0, 0, 700, 300, 0, 5])
    p = torch.tensor([0.9, 0.95, 0.8, 0.5, 0.9, 0.99, 1.0, 0.7])
    expected = sort_based_top_k_top_p(logits, k, p)
    out = apply_top_k_top_p(logits.clone(), k, p)
    kept, expected_kept = torch.isfinite(out), torch.isfinite(expected)
    assert torch.equal(kept, expected_kept), (kept.sum(1), expected_kept.sum(1))
    assert torch.equal(out[kept], logits[kept])
    assert int(kept[0].sum()) > 1024 and int(kept[3].sum()) < 128  # both paths ran


def test_random_sampling_never_draws_a_masked_token() -> None:
    torch.manual_seed(3)
    num_rows = 4000
    base = torch.full((VOCAB,), NEG_INF)
    base[3], base[7], base[VOCAB - 2] = 0.0, 1.0, -0.5  # the first and last are masked
    metadata = SamplingMetadata(
        all_greedy=False, all_random=True, temperature=None, is_greedy=None, top_k=None,
        top_p=None, min_p=None, penalties=None, generators={}, max_num_logprobs=None,
        is_partial=np.zeros(num_rows, dtype=bool),
    )
    sampled = Sampler()(base.repeat(num_rows, 1), metadata).sampled_token_ids
    counts = torch.bincount(sampled, minlength=VOCAB).double()
    assert set(torch.nonzero(counts).flatten().tolist()) == {3, 7, VOCAB - 2}
    probs = torch.softmax(base[[3, 7, VOCAB - 2]].double(), dim=0)
    assert _chi_square(counts[[3, 7, VOCAB - 2]], probs) < 13.82  # df = 2, p = 0.001


def test_min_p_mask_matches_reference() -> None:
    min_ps = [0.1, 0.0, 0.5, 0.3]
    logits = torch.tensor(ROWS)
    expected = torch.tensor([ref_min_p(r, m) for r, m in zip(ROWS, min_ps, strict=True)])
    assert torch.equal(apply_min_p(logits.clone(), torch.tensor(min_ps)), expected)


def test_min_p_is_applied_by_the_sampler_when_no_processor_owns_it() -> None:
    params = [SamplingParams(min_p=0.5), SamplingParams()]
    batch, _ = make_batch(params)
    assert metadata_for(batch).min_p is not None
    batch, _ = make_batch(params, processors=builtin_processors(2))
    assert metadata_for(batch).min_p is None  # MinPLogitsProcessor does it


def test_min_p_filters_sampled_tokens_through_the_processor() -> None:
    torch.manual_seed(0)
    num_rows = 8
    params = [SamplingParams(min_p=0.5)] * 4 + [SamplingParams()] * 4
    batch, _ = make_batch(params, processors=builtin_processors(num_rows))
    base = torch.zeros(VOCAB)
    base[:3] = torch.tensor([5.0, 4.9, 4.8])  # the rest has low but non-zero mass
    seen_low: list[set[bool]] = [set() for _ in range(num_rows)]
    for _ in range(50):
        sampled = Sampler()(base.repeat(num_rows, 1), metadata_for(batch)).sampled_token_ids
        for row, token in enumerate(sampled.tolist()):
            seen_low[row].add(token >= 3)
    assert all(s == {False} for s in seen_low[:4])  # min-p rows never leave the top 3
    assert all(True in s for s in seen_low[4:])  # the others do


# -- penalties --------------------------------------------------------------------------


def ref_penalties(row: torch.Tensor, params: SamplingParams, prompt: Sequence[int],
                  output: Sequence[int]) -> torch.Tensor:
    row = row.clone()
    for token in set(prompt) | set(output):
        r = params.repetition_penalty
        row[token] = row[token] / r if row[token] > 0 else row[token] * r
    for token in set(output):
        row[token] -= params.frequency_penalty * output.count(token)
        row[token] -= params.presence_penalty
    return row


def test_penalties_match_a_per_request_reference() -> None:
    gen = torch.Generator().manual_seed(3)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, VOCAB, (n,), generator=gen).tolist()

    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=0.0),  # no penalty: untouched
        SamplingParams(temperature=0.0, frequency_penalty=0.7, presence_penalty=-0.4),
        SamplingParams(temperature=0.0, repetition_penalty=0.8, frequency_penalty=-1.0,
                       presence_penalty=2.0),
        SamplingParams(temperature=0.0, presence_penalty=1.0),  # no output yet
    ]
    prompts = [tokens(5), tokens(7), tokens(3), tokens(9), tokens(4)]
    outputs = [tokens(6), tokens(2), tokens(11), tokens(4), []]
    batch, _ = make_batch(params, prompts=prompts, outputs=outputs)
    metadata = metadata_for(batch)
    assert metadata.penalties is not None and metadata.penalties.rows is not None
    assert metadata.penalties.rows.tolist() == [0, 2, 3, 4]
    logits = torch.randn(5, VOCAB, generator=gen) * 3
    processed = logits.clone()
    Sampler()(processed, metadata)  # greedy: penalties are applied in place, then argmax
    for i in range(5):
        expected = ref_penalties(logits[i], params[i], prompts[i], outputs[i])
        assert_close(processed[i], expected)


def test_penalties_on_every_row_use_no_row_index() -> None:
    params = [SamplingParams(presence_penalty=0.5, temperature=0.0),
              SamplingParams(repetition_penalty=2.0, temperature=0.0)]
    batch, _ = make_batch(params, prompts=[[1], [2, 2]], outputs=[[4, 4], []])
    metadata = metadata_for(batch)
    assert metadata.penalties is not None and metadata.penalties.rows is None
    logits = torch.ones(2, VOCAB)
    Sampler()(logits, metadata)
    expected = torch.ones(2, VOCAB)
    expected[0, 4] = 0.5
    expected[1, 2] = 0.5
    assert torch.equal(logits, expected)


def test_penalties_see_tokens_appended_by_the_batch() -> None:
    params = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    batch, states = make_batch([params], prompts=[[5]])
    for token in (7, 7, 9):
        batch.append_token(0, token)
    logits = torch.zeros(1, VOCAB)
    Sampler()(logits, metadata_for(batch))
    assert logits[0, 7] == -2.0 and logits[0, 9] == -1.0 and logits[0, 5] == 0.0
    assert states[0].output_token_ids == [7, 7, 9]


# -- seeds ------------------------------------------------------------------------------


def _run_seeded(layout: list[tuple[int, SamplingParams]], target: int, steps: int) -> list[int]:
    """Sample ``steps`` tokens; return those of request key ``target``."""
    batch, _ = make_batch([p for _, p in layout], req_ids=[f"k{k}" for k, _ in layout])
    sampler, tokens = Sampler(), []
    torch.manual_seed(999)  # the global generator: it must not matter for seeded rows
    for step in range(steps):
        keys = [int(req_id[1:]) for req_id in batch.req_ids]
        logits = torch.stack([logits_for(k, step) for k in keys])
        sampled = sampler(logits, metadata_for(batch)).sampled_token_ids
        tokens.append(int(sampled[keys.index(target)]))
        batch.append_tokens(np.arange(batch.num_reqs), sampled.numpy())
        torch.manual_seed(step)  # perturb the global generator between steps
    return tokens


def test_seeded_request_gets_the_same_tokens_alone_and_in_any_batch() -> None:
    seeded = SamplingParams(seed=42, temperature=1.5, top_p=0.9)
    alone = _run_seeded([(0, seeded)], target=0, steps=6)
    others = [
        (1, SamplingParams(temperature=0.0)),
        (2, SamplingParams(seed=7, temperature=0.7)),
        (3, SamplingParams(temperature=1.0, top_k=5)),
        (4, SamplingParams(seed=42, temperature=1.5, top_p=0.9)),  # same seed, other logits
        (5, SamplingParams(frequency_penalty=0.5, logprobs=2)),
    ]
    for shift in range(0, 6, 2):  # the seeded request at different slots
        layout = [*others[:shift], (0, seeded), *others[shift:]]
        assert _run_seeded(layout, target=0, steps=6) == alone
    assert len(set(alone)) > 1  # the test is not vacuous: the tokens vary


def _wide_batch(params: Sequence[SamplingParams], vocab: int) -> InputBatch:
    batch = InputBatch(len(params), 8, 1, vocab, "cpu", ())
    for i, p in enumerate(params):
        state = CachedRequestState(f"r{i}", (1,), p)
        if p.seed is not None:
            state.generator = torch.Generator().manual_seed(p.seed)
        batch.add_request(state)
    batch.commit_batch_update()
    return batch


def test_seeded_top_p_row_is_batch_independent_with_a_large_vocabulary() -> None:
    # With more tokens than the first candidate round holds, a row may be drawn from its
    # candidates or from its whole row; the choice must not depend on the other rows.
    vocab = 1000
    peaked = SamplingParams(seed=3, top_p=0.9)  # small nucleus: candidate path
    flat = SamplingParams(seed=4, top_p=0.3)  # nucleus ~300 tokens: whole-row path
    others = [SamplingParams(top_k=500), SamplingParams(), SamplingParams(temperature=0.0),
              SamplingParams(top_p=0.3, top_k=200)]

    def logits_of(key: int, step: int) -> torch.Tensor:
        row = torch.randn(vocab, generator=torch.Generator().manual_seed(key * 100 + step))
        return row * (4.0 if key == 0 else 0.2)

    def run(layout: list[tuple[int, SamplingParams]]) -> list[tuple[int, int]]:
        batch = _wide_batch([params for _, params in layout], vocab)
        keys = [key for key, _ in layout]
        tokens = []
        for step in range(5):
            logits = torch.stack([logits_of(key, step) for key in keys])
            sampled = Sampler()(logits, metadata_for(batch)).sampled_token_ids
            tokens.append((int(sampled[keys.index(0)]), int(sampled[keys.index(1)])))
        return tokens

    alone = run([(0, peaked), (1, flat)])
    for shift in (0, 2, 4):
        mixed = [(2 + i, params) for i, params in enumerate(others)]
        assert run([*mixed[:shift], (1, flat), (0, peaked), *mixed[shift:]]) == alone


@pytest.mark.parametrize("scale", [4.0, 0.05])  # peaked: candidates; flat: whole rows
def test_filtered_sampling_only_draws_tokens_the_filters_keep(scale: float) -> None:
    torch.manual_seed(11)
    vocab, num_rows = 1000, 16
    logits = torch.randn(num_rows, vocab) * scale
    k = torch.tensor([0, 300] * (num_rows // 2))
    p = torch.full((num_rows,), 0.6)
    kept = torch.isfinite(apply_top_k_top_p(logits.clone(), k, p))
    is_final = top_k_top_p_candidates(logits, k, p).is_final
    assert bool(is_final.all()) if scale > 1 else not bool(is_final.any())
    metadata = SamplingMetadata(
        all_greedy=False, all_random=True, temperature=None, is_greedy=None, top_k=k,
        top_p=p, min_p=None, penalties=None, generators={}, max_num_logprobs=None,
        is_partial=np.zeros(num_rows, dtype=bool),
    )
    for _ in range(5):
        sampled = Sampler()(logits.clone(), metadata).sampled_token_ids
        assert bool(kept.gather(1, sampled.unsqueeze(1)).all())


def test_partial_prefill_rows_do_not_advance_their_generator() -> None:
    params = [SamplingParams(seed=5), SamplingParams(seed=6), SamplingParams()]
    batch, states = make_batch(params)
    generator, other = states[0].generator, states[1].generator
    assert generator is not None and other is not None
    before, other_before = generator.get_state().clone(), other.get_state().clone()
    Sampler()(torch.randn(3, VOCAB), metadata_for(batch, [True, False, True]))
    assert torch.equal(generator.get_state(), before)
    assert not torch.equal(other.get_state(), other_before)

    # And the tokens after the partial step are those of a request that never had one.
    fresh, _ = make_batch([SamplingParams(seed=5)])
    batch_rows = torch.stack([logits_for(0, 1), logits_for(1, 1), logits_for(2, 1)])
    in_batch = Sampler()(batch_rows, metadata_for(batch)).sampled_token_ids[0]
    alone = Sampler()(logits_for(0, 1).unsqueeze(0), metadata_for(fresh)).sampled_token_ids[0]
    assert in_batch == alone


def test_resumed_seeded_request_continues_its_sequence() -> None:
    from engine.sdk.scheduler import NewRequestData

    params = SamplingParams(seed=11, temperature=1.2)
    straight = _run_seeded([(0, params)], target=0, steps=6)
    data = NewRequestData(req_id="k0", prompt_token_ids=(1, 2, 3), sampling_params=params,
                          block_ids=(), num_computed_tokens=0,
                          output_token_ids=tuple(straight[:4]))
    state = CachedRequestState.from_new_request(data, device="cpu")
    batch = InputBatch(1, 64, 4, VOCAB, "cpu", ())
    batch.add_request(state)
    batch.commit_batch_update()
    resumed = []
    for step in (4, 5):
        sampled = Sampler()(logits_for(0, step).unsqueeze(0), metadata_for(batch))
        resumed.append(int(sampled.sampled_token_ids[0]))
        batch.append_token(0, resumed[-1])
    assert resumed == straight[4:]
    assert state.output_token_ids == straight


# -- logprobs ---------------------------------------------------------------------------


def test_logprobs_are_raw_and_column_zero_is_the_sampled_token() -> None:
    ctx = LogitsProcessorContext(max_num_reqs=4, vocab_size=VOCAB)
    params = [
        SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=2.0),
        SamplingParams(temperature=3.0, logprobs=0, logit_bias={4: 100.0}),
        SamplingParams(temperature=0.5, top_k=2, frequency_penalty=2.0),
        SamplingParams(temperature=2.0, logprobs=5, presence_penalty=-2.0),
    ]
    batch, _ = make_batch(params, processors=[LogitBiasLogitsProcessor(ctx)],
                          outputs=[[1, 2], [3], [4, 4], [5]])
    metadata = metadata_for(batch)
    assert metadata.max_num_logprobs == 5
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0)) * 4
    out = Sampler()(logits.clone(), metadata)
    assert out.logprobs is not None
    raw = torch.log_softmax(logits, dim=1)
    sampled = out.sampled_token_ids
    assert sampled[1] == 4  # the bias decided the token ...
    assert torch.equal(out.logprobs.token_ids[:, 0], sampled)
    assert_close(out.logprobs.logprobs[:, 0], raw.gather(1, sampled[:, None])[:, 0])
    top = raw.topk(5, dim=1)
    assert torch.equal(out.logprobs.token_ids[:, 1:], top.indices)
    assert_close(out.logprobs.logprobs[:, 1:], top.values)  # ... not the logprob
    assert bool((out.logprobs.logprobs[:, 1:].diff(dim=1) <= 0).all())
    expected_ranks = (raw > raw.gather(1, sampled[:, None])).sum(dim=1) + 1
    assert torch.equal(out.logprobs.ranks, expected_ranks)
    assert out.logprobs.ranks[0] == 1 or params[0].repetition_penalty != 1.0

    converted = to_sample_logprobs(out.logprobs, [3, 0, 0, 5])
    assert [len(ids) for ids in converted.token_ids] == [4, 1, 1, 6]
    assert converted.token_ids[1] == (4,)
    assert converted.sampled_token_ranks == tuple(expected_ranks.tolist())
    with pytest.raises(ValueError, match="only 5"):
        to_sample_logprobs(out.logprobs, [6, 0, 0, 0])


def test_gather_logprobs_for_prompt_tokens() -> None:
    logprobs = torch.log_softmax(torch.tensor([[1.0, 3.0, 2.0], [0.0, 0.0, 5.0]]), dim=1)
    result = gather_logprobs(logprobs, 2, torch.tensor([2, 0]))
    assert isinstance(result, LogprobsTensors)
    assert result.token_ids[:, :2].tolist() == [[2, 1], [0, 2]]
    assert result.ranks.tolist() == [2, 2]  # ties rank as the best of them
    assert gather_logprobs(logprobs, 0, torch.tensor([1, 2])).token_ids.shape == (2, 1)
    selected = result.select([1])
    assert selected.token_ids[:, :2].tolist() == [[0, 2]]
