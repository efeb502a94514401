"""Scheduling scenarios end to end: each gives the plain run's tokens and frees every block."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.core import LLM, SamplingParams
from engine.testing.engine import assert_kv_pool_full

PROMPTS = [list(range(3, 3 + n)) for n in (5, 23, 9, 41, 2, 17)]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def make_llm(path: Path, **kwargs: Any) -> LLM:
    options: dict[str, Any] = {"dtype": "float32", "block_size": 4, "num_kv_blocks": 256}
    options.update(kwargs)
    return LLM(str(path), in_process=True, **options)


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def plain(tiny_llama: Path) -> list[list[int]]:
    llm = make_llm(tiny_llama, enable_prefix_caching=False)
    tokens = run(llm, PROMPTS)
    assert_kv_pool_full(llm)
    return tokens


def test_prefix_cache_hits_give_the_same_tokens(tiny_llama: Path, plain) -> None:
    llm = make_llm(tiny_llama)
    assert run(llm, PROMPTS) == plain
    # Second time round the prompts' full blocks come from the cache.
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == plain
    assert outputs[3].num_cached_tokens == 40  # 41 tokens: 10 full blocks of 4
    assert_kv_pool_full(llm)


def test_chunked_prefill_gives_the_same_tokens(tiny_llama: Path, plain) -> None:
    llm = make_llm(tiny_llama, max_num_batched_tokens=8, max_num_seqs=4)
    assert run(llm, PROMPTS) == plain
    assert_kv_pool_full(llm)


def test_forced_preemption_gives_the_same_tokens(tiny_llama: Path, plain) -> None:
    # 24 blocks of 4 tokens cannot hold all six sequences (up to 61 tokens each) at once.
    llm = make_llm(tiny_llama, num_kv_blocks=24, max_model_len=64)
    preempted = 0
    engine = llm.llm_engine
    original = engine.core.scheduler.schedule

    def counting_schedule():
        nonlocal preempted
        out = original()
        preempted += len(out.preempted_req_ids)
        return out

    engine.core.scheduler.schedule = counting_schedule  # type: ignore[method-assign]
    assert run(llm, PROMPTS) == plain
    assert preempted > 0
    assert_kv_pool_full(llm)


def test_abort_mid_generation_frees_blocks_and_leaves_others_intact(
    tiny_llama: Path, plain
) -> None:
    llm = make_llm(tiny_llama)
    engine = llm.llm_engine
    outputs = [engine.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
               for i, p in enumerate(PROMPTS)]
    for _ in range(5):
        engine.step()
    engine.abort_request("1")
    engine.abort_request("4")
    while engine.has_unfinished_requests():
        engine.step()
    for i, output in enumerate(outputs):
        if i in (1, 4):
            assert output.outputs[0].finish_reason == "abort"
            assert len(output.outputs[0].token_ids) < 20
        else:
            assert output.outputs[0].token_ids == plain[i]
    assert_kv_pool_full(llm)


def test_n_greater_than_one_shares_prompt_blocks(tiny_llama: Path, plain) -> None:
    llm = make_llm(tiny_llama)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=3)
    [out] = llm.generate({"prompt_token_ids": PROMPTS[3]}, params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.token_ids == plain[3] for c in out.outputs)
    assert_kv_pool_full(llm)


def test_n_greater_than_one_shares_blocks_while_running(tiny_llama: Path) -> None:
    llm = make_llm(tiny_llama)
    engine = llm.llm_engine
    engine.add_request("r", {"prompt_token_ids": PROMPTS[3]},
                       SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=3))
    engine.step()
    held = engine.core.make_stats()
    # 41-token prompt: 10 full blocks shared by the 3 choices, plus one private tail each.
    assert held.num_total_blocks - held.num_free_blocks == 10 + 3
    while engine.has_unfinished_requests():
        engine.step()
    assert_kv_pool_full(llm)


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(tiny_llama: Path) -> None:
    llm = make_llm(tiny_llama)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24,
                            ignore_eos=True)
    alone = run(llm, [PROMPTS[1]], seeded)[0]
    others = [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=7, max_tokens=24, ignore_eos=True)]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3]]
    params = [others[0], seeded, others[1], others[2]]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert outputs[1].outputs[0].token_ids == alone
    assert_kv_pool_full(llm)


def test_stop_strings_min_tokens_and_finish_reasons(tiny_llama: Path) -> None:
    llm = make_llm(tiny_llama)
    tokenizer = llm.get_tokenizer()
    free = run(llm, [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=20,
                                                 ignore_eos=True))[0]
    text = tokenizer.decode(free)
    stop = text[5:7]
    [out] = llm.generate({"prompt_token_ids": PROMPTS[0]},
                         SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                        stop=[stop]), use_tqdm=False)
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == text[: text.index(stop)]
    assert stop not in completion.text
    [out] = llm.generate({"prompt_token_ids": PROMPTS[0]},
                         SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert out.outputs[0].finish_reason in ("length", "stop")
    assert_kv_pool_full(llm)
