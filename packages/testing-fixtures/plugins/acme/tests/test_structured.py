"""acme_regex: matchers driven directly with a real tokenizer, then an engine whose
constrained requests match and whose other requests are untouched."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from acme_engine_plugins.structured import RegexBackend, RegexGrammar

from engine.core import SamplingParams
from engine.sdk import ValidationError
from engine.sdk.structured_output import (
    StructuredOutputContext,
    StructuredOutputMatcher,
    StructuredOutputsParams,
)

PHONE = r"[0-9]{3}-[0-9]{4}"


@pytest.fixture(scope="module")
def backend(tiny_llama: Path) -> RegexBackend:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    return RegexBackend(StructuredOutputContext(
        plugin_name="acme_regex", options=RegexBackend.Options(), tokenizer=tokenizer,
        vocab_size=512, eos_token_ids=(tokenizer.eos_token_id,), process="engine_core"))


def allowed(matcher: StructuredOutputMatcher) -> set[int]:
    bitmask = torch.zeros((1, 16), dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    return {i for i in range(512) if bitmask[0, i // 32] >> (i % 32) & 1}


def ids(backend: RegexBackend, text: str) -> list[int]:
    tokenizer: Any = backend.ctx.tokenizer
    return list(tokenizer.encode(text, add_special_tokens=False))


def test_a_regex_is_followed_then_ends(backend: RegexBackend) -> None:
    matcher = backend.matcher(backend.compile(StructuredOutputsParams(regex="ab?c")))
    assert allowed(matcher) == set(ids(backend, "a"))
    assert not matcher.accept_tokens(ids(backend, "ax"))  # refused: as before the call
    assert matcher.accept_tokens(ids(backend, "a"))
    assert allowed(matcher) == set(ids(backend, "bc"))
    assert matcher.accept_tokens(ids(backend, "bc"))
    eos = backend.ctx.eos_token_ids[0]
    assert allowed(matcher) == {eos}
    assert matcher.accept_tokens([eos]) and matcher.is_terminated()
    matcher.rollback(2)
    assert not matcher.is_terminated() and allowed(matcher) == set(ids(backend, "c"))


def test_choice_is_served_too(backend: RegexBackend) -> None:
    grammar = backend.compile(StructuredOutputsParams(choice=("yes", "no", "y.s")))
    assert isinstance(grammar, RegexGrammar)
    assert grammar.is_complete("y.s") and not grammar.is_complete("yes.")
    assert not grammar.can_continue("yxs")  # the dot is a literal dot


@pytest.mark.parametrize(("params", "param"), [
    (StructuredOutputsParams(json_object=True), "structured_outputs.json_object"),
    (StructuredOutputsParams(regex="(unclosed"), "structured_outputs.regex"),
])
def test_what_it_cannot_serve_is_a_400(backend: RegexBackend, params: StructuredOutputsParams,
                                       param: str) -> None:
    with pytest.raises(ValidationError) as info:
        backend.validate(params)
    assert info.value.param == param


def test_selected_it_constrains_only_the_requests_that_ask(
    tiny_qwen3: Path, make_llm: Callable[..., Any], spy: Callable[..., Any],
    prompts: list[list[int]], qwen3_tokens: list[list[int]],
) -> None:
    calls = spy(RegexBackend, "compile")
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    phone = SamplingParams(temperature=0, max_tokens=12,
                           structured_outputs=StructuredOutputsParams(regex=PHONE))
    with make_llm(tiny_qwen3, structured_outputs_backend="acme_regex") as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts] * 2,
                               [free] * len(prompts) + [phone] * len(prompts), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs[:len(prompts)]] == qwen3_tokens
    for output in outputs[len(prompts):]:
        assert re.fullmatch(PHONE, output.outputs[0].text), output.outputs[0].text
        assert output.outputs[0].finish_reason == "stop"
    assert calls["compile"] == 1  # one spec: compiled once, cached


def test_not_selected_it_is_never_asked(
    tiny_qwen3: Path, make_llm: Callable[..., Any], spy: Callable[..., Any],
) -> None:
    calls = spy(RegexBackend, "__init__")
    with make_llm(tiny_qwen3) as llm:  # xgrammar serves the regex
        [output] = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(
            temperature=0, max_tokens=12,
            structured_outputs=StructuredOutputsParams(regex=PHONE)), use_tqdm=False)
    assert re.fullmatch(PHONE, output.outputs[0].text) and calls["__init__"] == 0
