"""A structured-output backend that proves the seam is reached, and only by its requests.

``test_digits`` serves ``structured_outputs.regex`` only: any other kind is refused by
``validate`` with a ``ValidationError`` that says so (HTTP 400). Whatever the pattern, it
constrains the output to ASCII digits: the allowed tokens are those whose text (each token
id decoded with the tokenizer) is one or more of ``0-9``, plus the end-of-sequence tokens
once ``min_digits`` digits are out (``--plugin-option test_digits.min_digits=N``, default
3). The grammar is complete when it accepts an end-of-sequence token.

:data:`CALLS` counts every call: ``"init.<process>"`` per construction, and ``"validate"``,
``"compile"``, ``"matcher"``, ``"fill_bitmask"`` (the batch call), ``"fill_bitmask.rows"``,
``"accept_tokens"``, ``"rollback"``, ``"shutdown"``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from pydantic import Field

from engine.sdk import PluginOptions, ValidationError
from engine.sdk.structured_output import (
    StructuredOutputBackend,
    StructuredOutputContext,
    StructuredOutputMatcher,
    StructuredOutputsParams,
)

CALLS: Counter[str] = Counter()


def _digits_in(text: str) -> int:
    """How many digits ``text`` is, or 0 when it is not all ASCII digits."""
    return len(text) if text and text.isascii() and text.isdigit() else 0


@dataclass(frozen=True)
class DigitsGrammar:
    """The compiled form: the digit tokens, their lengths and the two bitmask rows.

    Attributes:
        digit_lengths: Token id -> how many digits its text is.
        eos_token_ids: What ends the output (allowed after ``min_digits``).
        min_digits: Digits needed before an end-of-sequence token.
        digits_row: Bitmask row (int32 words) allowing the digit tokens.
        digits_or_eos_row: The same, plus the end-of-sequence tokens.
    """

    digit_lengths: Mapping[int, int]
    eos_token_ids: frozenset[int]
    min_digits: int
    digits_row: Any
    digits_or_eos_row: Any


def _row(token_ids: Sequence[int], words: int) -> Any:
    import torch

    values = [0] * words
    for token in token_ids:
        values[token // 32] |= 1 << (token % 32)
    return torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in values],
                        dtype=torch.int32)


class DigitsBackend(StructuredOutputBackend):
    """Digits only, for ``structured_outputs.regex`` requests (see the module docstring)."""

    class Options(PluginOptions):
        min_digits: int = Field(3, ge=0, description="digits before end of sequence is allowed")

    def __init__(self, ctx: StructuredOutputContext) -> None:
        super().__init__(ctx)
        self.options = cast(DigitsBackend.Options, ctx.options)
        self._grammar: DigitsGrammar | None = None
        CALLS[f"init.{ctx.process}"] += 1

    def validate(self, params: StructuredOutputsParams) -> None:
        CALLS["validate"] += 1
        self._check(params)

    @staticmethod
    def _check(params: StructuredOutputsParams) -> None:
        if params.kind != "regex":
            raise ValidationError(
                f"structured_outputs.{params.kind} is not served by the test_digits backend; "
                f"it serves structured_outputs.regex only",
                param=f"structured_outputs.{params.kind}")

    def compile(self, params: StructuredOutputsParams) -> DigitsGrammar:
        CALLS["compile"] += 1
        self._check(params)
        if self._grammar is None:  # the same for every spec: built once
            ctx = self.ctx
            tokenizer = ctx.tokenizer
            size = min(len(tokenizer), ctx.vocab_size)
            lengths = {i: n for i in range(size) if (n := _digits_in(tokenizer.decode([i])))}
            words = -(-ctx.vocab_size // 32)
            eos = frozenset(ctx.eos_token_ids)
            self._grammar = DigitsGrammar(
                digit_lengths=lengths, eos_token_ids=eos, min_digits=self.options.min_digits,
                digits_row=_row(sorted(lengths), words),
                digits_or_eos_row=_row(sorted({*lengths, *eos}), words))
        return self._grammar

    def matcher(self, grammar: Any) -> DigitsMatcher:
        CALLS["matcher"] += 1
        return DigitsMatcher(grammar)

    def fill_bitmask(self, matchers: Sequence[StructuredOutputMatcher], bitmask: Any) -> None:
        CALLS["fill_bitmask"] += 1
        super().fill_bitmask(matchers, bitmask)

    def shutdown(self) -> None:
        CALLS["shutdown"] += 1


class DigitsMatcher(StructuredOutputMatcher):
    """One request's digits so far."""

    def __init__(self, grammar: DigitsGrammar) -> None:
        self.grammar = grammar
        self.accepted: list[int] = []
        self.num_digits = 0

    def _allows(self, token: int) -> bool:
        if self.is_terminated():
            return False
        if token in self.grammar.digit_lengths:
            return True
        return token in self.grammar.eos_token_ids and self.num_digits >= self.grammar.min_digits

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        CALLS["accept_tokens"] += 1
        for done, token in enumerate(token_ids):
            if not self._allows(int(token)):
                self._undo(done)
                return False
            self.accepted.append(int(token))
            self.num_digits += self.grammar.digit_lengths.get(int(token), 0)
        return True

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        CALLS["fill_bitmask.rows"] += 1
        grammar = self.grammar
        bitmask[row] = (grammar.digits_or_eos_row if self.num_digits >= grammar.min_digits
                        else grammar.digits_row)

    def rollback(self, num_tokens: int) -> None:
        CALLS["rollback"] += 1
        self._undo(num_tokens)

    def _undo(self, num_tokens: int) -> None:
        for _ in range(num_tokens):
            self.num_digits -= self.grammar.digit_lengths.get(self.accepted.pop(), 0)

    def is_terminated(self) -> bool:
        return bool(self.accepted) and self.accepted[-1] in self.grammar.eos_token_ids
