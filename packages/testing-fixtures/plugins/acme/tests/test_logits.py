"""acme_no_repeat_ngram: the conformance suite, and in an engine it changes only the requests
that ask for it."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from acme_engine_plugins.logits import KEY, NoRepeatNGram, banned_tokens

from engine.sdk.errors import ValidationError
from engine.sdk.sampling_params import SamplingParams
from engine.testing.contracts import check_logits_processor


def make_params(rng: random.Random) -> SamplingParams:
    if rng.random() < 0.4:
        return SamplingParams()  # requests that do not use the processor
    return SamplingParams(extra_args={KEY: rng.randint(1, 4)})


def reference(params: SamplingParams, prompt_token_ids: Any, output_token_ids: list[int],
              row: torch.Tensor) -> torch.Tensor:
    n = (params.extra_args or {}).get(KEY)
    if n is not None:
        for token in banned_tokens([*(prompt_token_ids or ()), *output_token_ids], n):
            row[token] = float("-inf")
    return row


@pytest.mark.parametrize("seed", [0, 1])
def test_conforms(seed: int) -> None:
    check_logits_processor(NoRepeatNGram, make_params, reference=reference, steps=600,
                           seed=seed)


def test_banned_tokens() -> None:
    assert banned_tokens([1, 2, 3, 1, 2], 3) == {3}  # "1 2" was followed by 3
    assert banned_tokens([1, 2, 3], 1) == {1, 2, 3}
    assert banned_tokens([1, 2], 3) == set()


@pytest.mark.parametrize("bad", [0, 33, "2", 2.0])
def test_bad_sizes_are_refused_naming_the_key(bad: object) -> None:
    with pytest.raises(ValidationError) as info:
        NoRepeatNGram.validate_params(SamplingParams(extra_args={KEY: bad}))
    assert info.value.param == f"extra_args.{KEY}"


def generated_a_repeat(prompt: list[int], output: list[int], n: int) -> bool:
    """Whether a generated token completed an n-gram seen earlier in prompt + output."""
    tokens = prompt + output
    seen = {tuple(tokens[i:i + n]) for i in range(len(prompt) - n + 1)}
    for end in range(max(len(prompt), n - 1), len(tokens)):
        gram = tuple(tokens[end - n + 1:end + 1])
        if gram in seen:
            return True
        seen.add(gram)
    return False


def test_only_the_requests_that_ask_are_changed(
    tiny_qwen3: Path, make_llm: Callable[..., Any], qwen3_tokens: list[list[int]],
    prompts: list[list[int]],
) -> None:
    repeating = [i for i, t in enumerate(qwen3_tokens) if generated_a_repeat(prompts[i], t, 2)]
    # the tiny model repeats itself in some outputs (they ask), not in all (they do not)
    assert 0 < len(repeating) < len(prompts)
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                             extra_args={KEY: 2} if i in repeating else None)
              for i in range(len(prompts))]
    with make_llm(tiny_qwen3) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    for i, got in enumerate(tokens):
        if i in repeating:
            assert not generated_a_repeat(prompts[i], got, 2), got
        else:
            assert got == qwen3_tokens[i]  # untouched


def test_a_misspelt_key_is_refused(tiny_qwen3: Path, make_llm: Callable[..., Any]) -> None:
    with make_llm(tiny_qwen3) as llm, pytest.raises(ValidationError, match="no_repeat_ngram"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                     SamplingParams(max_tokens=2, extra_args={"no_repeat_ngram": 2}),
                     use_tqdm=False)
