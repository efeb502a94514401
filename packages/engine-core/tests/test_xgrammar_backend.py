"""The built-in ``xgrammar`` backend on the tiny checkpoint's tokenizer, and the worker's mask.

The tokenizer is byte-level (one token per byte, ids 3..258; 0-2 are ``<unk>``, ``<s>``,
``</s>``) under a 512-wide LM head, so every allowed set below can be written out by hand.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.core.structured_output.bitmask import allowed_tokens, apply_grammar_bitmask
from engine.core.structured_output.xgrammar_backend import XgrammarBackend
from engine.sdk.errors import ValidationError
from engine.sdk.structured_output import (
    GrammarBitmask,
    StructuredOutputContext,
    StructuredOutputMatcher,
    StructuredOutputsParams,
)

VOCAB = 512  # the tiny Llama's logits; its tokenizer has 259 tokens
EOS = 2
WORDS = math.ceil(VOCAB / 32)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


@pytest.fixture(scope="module")
def backend(tokenizer: Any) -> XgrammarBackend:
    return XgrammarBackend(StructuredOutputContext(
        plugin_name="xgrammar", options=XgrammarBackend.Options.model_validate({}),
        process="engine_core", model="tiny", tokenizer=tokenizer, vocab_size=VOCAB,
        eos_token_ids=(EOS,)))


def ids(tokenizer: Any, text: str) -> list[int]:
    token_ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return token_ids


def matcher(backend: XgrammarBackend, **spec: Any) -> StructuredOutputMatcher:
    return backend.matcher(backend.compile(StructuredOutputsParams(**spec)))


def allowed(m: StructuredOutputMatcher) -> set[int]:
    """The tokens ``m`` allows next, read bit by bit: bit j of word i is token 32 * i + j."""
    bitmask = torch.zeros((1, WORDS), dtype=torch.int32)
    m.fill_bitmask(bitmask, 0)
    return {32 * i + j for i, word in enumerate(bitmask[0].tolist()) for j in range(32)
            if (word >> j) & 1}


def test_bitmask_layout_is_one_bit_per_token_in_32_bit_words(backend: XgrammarBackend,
        tokenizer: Any) -> None:
    m = matcher(backend, regex="[ab]")
    a, b = ids(tokenizer, "ab")
    assert allowed(m) == {a, b}
    bitmask = torch.zeros((2, WORDS), dtype=torch.int32)
    m.fill_bitmask(bitmask, 1)  # only the row asked for is written
    assert not bitmask[0].any()
    assert int(bitmask[1, a // 32]) & (1 << (a % 32))
    assert allowed_tokens(bitmask, VOCAB)[1].nonzero().flatten().tolist() == [a, b]
    assert m.accept_tokens([a])
    assert allowed(m) == {EOS}  # the grammar is complete: only end of sequence
    assert not m.is_terminated()
    assert m.accept_tokens([EOS])
    assert m.is_terminated()


def test_a_refused_token_leaves_the_matcher_as_before(backend: XgrammarBackend,
        tokenizer: Any) -> None:
    m = matcher(backend, regex="abc")
    a, b, x = ids(tokenizer, "abx")
    assert not m.accept_tokens([a, b, x])  # a and b fit, x does not: all three undone
    assert allowed(m) == {a}
    assert m.accept_tokens([a, b])
    assert allowed(m) == set(ids(tokenizer, "c"))


def test_rollback_undoes_accepted_tokens(backend: XgrammarBackend,
        tokenizer: Any) -> None:
    m = matcher(backend, regex="ab(c|d)")
    assert m.accept_tokens(ids(tokenizer, "abc"))
    assert allowed(m) == {EOS}
    m.rollback(1)
    assert allowed(m) == set(ids(tokenizer, "cd"))
    m.rollback(2)
    assert allowed(m) == set(ids(tokenizer, "a"))


def test_choice_json_and_grammar_allow_what_their_spec_says(backend: XgrammarBackend,
        tokenizer: Any) -> None:
    assert allowed(matcher(backend, choice=["yes", "no"])) == set(ids(tokenizer, "yn"))
    assert allowed(matcher(backend, json_object=True, disable_any_whitespace=True)) == set(
        ids(tokenizer, "{"))
    assert allowed(matcher(backend, json={"type": "integer"})) == set(
        ids(tokenizer, "-0123456789"))
    m = matcher(backend, grammar='root ::= "x" [0-9]{2}')
    assert m.accept_tokens(ids(tokenizer, "x4"))
    assert allowed(m) == set(ids(tokenizer, "0123456789"))


def test_tokens_beyond_the_tokenizer_are_never_allowed(backend: XgrammarBackend) -> None:
    # A string may hold almost any byte; ids 259..511 have no text and stay disallowed.
    everything = allowed(matcher(backend, regex="(.|\n)*"))
    assert everything and max(everything) < 259


@pytest.mark.parametrize("schema", [{"type": "string"}, {"type": "string", "maxLength": 3},
                                    {"type": "string", "minLength": 1}])
def test_json_strings_refuse_raw_control_characters(backend: XgrammarBackend,
                                                    tokenizer: Any, schema: Any) -> None:
    m = matcher(backend, json=schema)
    assert m.accept_tokens(ids(tokenizer, '"'))
    inside = allowed(m)
    assert set(ids(tokenizer, "aZ7 <")) <= inside
    assert not inside & set(ids(tokenizer, "".join(map(chr, range(32)))))  # JSON escapes them
    # An escape is fine, except in a length-bounded string (xgrammar 0.2 has none there).
    assert m.accept_tokens(ids(tokenizer, "\\n")) is (len(schema) == 1)


@pytest.mark.parametrize(("spec", "param", "message"), [
    ({"regex": "(ab"}, "structured_outputs.regex",
     "structured_outputs.regex is not a valid regex: Regex parsing error at position 4: "
     "The parenthesis is not closed."),
    ({"grammar": "root ::= foo"}, "structured_outputs.grammar",
     'structured_outputs.grammar is not a valid EBNF grammar: EBNF parser error at line 1, '
     'column 10: Rule "foo" is not defined'),
    ({"json": {"type": "nope"}}, "structured_outputs.json",
     'structured_outputs.json is not a JSON schema xgrammar supports: Unsupported type "nope"'),
])
def test_validate_names_the_field_without_xgrammars_prefix(spec: dict[str, Any], param: str,
                                                           message: str) -> None:
    import xgrammar as xgr

    # xgrammar's own message starts "[hh:mm:ss] /path/file.cc:N: "; the client never sees it.
    with pytest.raises(RuntimeError, match=r"^\[\d+:\d+:\d+\] \S+\.cc:\d+: "):
        xgr.Grammar.from_regex("(ab")
    # validate needs no tokenizer: the front end's check compiles nothing.
    frontend = XgrammarBackend(StructuredOutputContext(plugin_name="xgrammar",
                                                       process="frontend"))
    with pytest.raises(ValidationError) as info:
        frontend.validate(StructuredOutputsParams(**spec))
    assert info.value.param == param
    assert str(info.value) == message
    assert not re.search(r"\[\d+:\d+:\d+\]|\.cc:\d+", str(info.value))


def test_compile_refuses_the_same_specs(backend: XgrammarBackend) -> None:
    with pytest.raises(ValidationError, match="^structured_outputs.regex is not a valid regex"):
        backend.compile(StructuredOutputsParams(regex="a{2,1}"))


# -- the worker's step: apply_grammar_bitmask -------------------------------------------------

def row_of(vocab: int, tokens: list[int]) -> list[int]:
    """One bitmask row allowing ``tokens`` (int32 words, bit 31 included)."""
    words = [0] * math.ceil(vocab / 32)
    for token in tokens:
        words[token // 32] |= 1 << (token % 32)
    return [w - (1 << 32) if w >= 1 << 31 else w for w in words]


def test_apply_masks_the_rows_of_the_masks_requests_by_id() -> None:
    vocab = 40  # not a multiple of 32: the second word's high bits are padding
    logits = torch.randn(3, vocab)
    before = logits.clone()
    grammar = GrammarBitmask(("c", "a", "gone"), torch.tensor(
        [row_of(vocab, [1, 31, 39]), row_of(vocab, []), row_of(vocab, [5])],
        dtype=torch.int32))
    apply_grammar_bitmask(logits, grammar, ["a", "b", "c"])
    # "c" (batch row 2) keeps tokens 1, 31 (the sign bit) and 39 only.
    kept = torch.isfinite(logits[2]).nonzero().flatten().tolist()
    assert kept == [1, 31, 39]
    assert torch.equal(logits[2, kept], before[2, kept])
    # "a"'s row allows nothing: left unmasked (the grammar then refuses and fails it).
    assert torch.equal(logits[0], before[0])
    # "b" has no row, "gone" is not in the batch.
    assert torch.equal(logits[1], before[1])


def test_apply_with_no_row_in_the_batch_changes_nothing() -> None:
    logits = torch.randn(2, 64)
    before = logits.clone()
    grammar = GrammarBitmask(("x",), torch.tensor([row_of(64, [3])], dtype=torch.int32))
    apply_grammar_bitmask(logits, grammar, ["a", "b"])
    assert torch.equal(logits, before)


def test_a_sampled_row_follows_the_mask(backend: XgrammarBackend,
        tokenizer: Any) -> None:
    m = matcher(backend, choice=["yes", "no"])
    bitmask = torch.zeros((1, WORDS), dtype=torch.int32)
    m.fill_bitmask(bitmask, 0)
    logits = torch.randn(2, VOCAB)
    logits[1, ids(tokenizer, "q")] = 100.0  # the model's favourite is not a choice
    apply_grammar_bitmask(logits, GrammarBitmask(("r",), bitmask), ["other", "r"])
    assert int(logits[1].argmax()) in set(ids(tokenizer, "yn"))
    assert int(logits[0].isfinite().sum()) == VOCAB
