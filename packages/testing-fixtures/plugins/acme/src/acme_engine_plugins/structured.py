"""``engine.structured_output_backends`` entry ``acme_regex``: regex and choice constraints.

Serves ``structured_outputs.regex`` and ``structured_outputs.choice`` (a choice is the
regex of its escaped alternatives) with the ``regex`` module's partial matching: a token is
allowed when the text so far plus the token's text can still be extended to a full match,
and an end-of-sequence token when the text so far is a full match. A grammar caches one
bitmask row per text prefix. Token texts come from decoding each id alone, which suits
byte-level BPE tokenizers. ``json``, ``json_object`` and ``grammar`` are refused (400).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import regex
import torch
from pydantic import Field

from engine.sdk import PluginOptions, ValidationError
from engine.sdk.structured_output import (
    StructuredOutputBackend,
    StructuredOutputContext,
    StructuredOutputMatcher,
    StructuredOutputsParams,
)

SERVED = ("regex", "choice")


def bitmask_row(token_ids: Sequence[int], num_words: int) -> torch.Tensor:
    """One bitmask row allowing ``token_ids``: bit j of word i allows token 32 * i + j."""
    words = [0] * num_words
    for token in token_ids:
        words[token // 32] |= 1 << (token % 32)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words],
                        dtype=torch.int32)


@dataclass
class RegexGrammar:
    """A compiled spec, shared by every request with it; rows cached per text prefix."""

    pattern: Any  # regex.Pattern
    token_texts: dict[int, str]
    eos_token_ids: tuple[int, ...]
    num_words: int
    rows: dict[str, torch.Tensor] = field(default_factory=dict)

    def can_continue(self, text: str) -> bool:
        return self.pattern.fullmatch(text, partial=True) is not None

    def is_complete(self, text: str) -> bool:
        return self.pattern.fullmatch(text) is not None

    def allows(self, prefix: str, token: int) -> bool:
        if token in self.eos_token_ids:
            return self.is_complete(prefix)
        text = self.token_texts.get(token)
        return text is not None and self.can_continue(prefix + text)

    def row(self, prefix: str) -> torch.Tensor:
        row = self.rows.get(prefix)
        if row is None:
            allowed = [t for t, text in self.token_texts.items()
                       if self.can_continue(prefix + text)]
            if self.is_complete(prefix):
                allowed.extend(self.eos_token_ids)
            row = self.rows[prefix] = bitmask_row(allowed, self.num_words)
        return row


class RegexMatcher(StructuredOutputMatcher):
    """One request's tokens and text so far."""

    def __init__(self, grammar: RegexGrammar) -> None:
        self.grammar = grammar
        self.tokens: list[int] = []
        self.texts: list[str] = []

    @property
    def prefix(self) -> str:
        return "".join(self.texts)

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        for done, token in enumerate(token_ids):
            if self.is_terminated() or not self.grammar.allows(self.prefix, token):
                self.rollback(done)  # as before the call
                return False
            self.tokens.append(token)
            self.texts.append(self.grammar.token_texts.get(token, ""))
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = self.grammar.row(self.prefix)

    def rollback(self, num_tokens: int) -> None:
        for _ in range(num_tokens):
            self.tokens.pop()
            self.texts.pop()

    def is_terminated(self) -> bool:
        return bool(self.tokens) and self.tokens[-1] in self.grammar.eos_token_ids


class RegexBackend(StructuredOutputBackend):
    """``--structured-outputs-backend acme_regex``: regex and choice."""

    class Options(PluginOptions):
        max_pattern_length: int = Field(1000, ge=1, description="longest regex accepted")

    def __init__(self, ctx: StructuredOutputContext) -> None:
        super().__init__(ctx)
        self.options = cast(RegexBackend.Options, ctx.options)
        self._token_texts: dict[int, str] | None = None  # built by the first compile
        self._lock = threading.Lock()

    def validate(self, params: StructuredOutputsParams) -> None:
        self._pattern(params)

    def _pattern(self, params: StructuredOutputsParams) -> Any:
        kind = params.kind
        if kind not in SERVED:
            raise ValidationError(
                f"structured_outputs.{kind} is not served by acme_regex; it serves "
                f"structured_outputs.regex and structured_outputs.choice",
                param=f"structured_outputs.{kind}")
        if kind == "choice":
            source = "|".join(regex.escape(choice) for choice in params.choice or ())
        else:
            source = params.regex or ""
        if len(source) > self.options.max_pattern_length:
            raise ValidationError(
                f"structured_outputs.{kind} is {len(source)} characters as a regex; acme_regex "
                f"takes at most {self.options.max_pattern_length}",
                param=f"structured_outputs.{kind}")
        try:
            return regex.compile(source)
        except regex.error as exc:
            raise ValidationError(f"structured_outputs.regex is not a valid regex: {exc}",
                                  param="structured_outputs.regex") from None

    def compile(self, params: StructuredOutputsParams) -> RegexGrammar:
        ctx = self.ctx
        return RegexGrammar(self._pattern(params), self._texts(), ctx.eos_token_ids,
                            num_words=-(-ctx.vocab_size // 32))

    def _texts(self) -> dict[int, str]:
        """Token id -> its text, for every token that has one (special tokens left out)."""
        with self._lock:
            if self._token_texts is None:
                tokenizer: Any = self.ctx.tokenizer
                special = set(tokenizer.all_special_ids)
                size = min(len(tokenizer), self.ctx.vocab_size)
                texts = {i: tokenizer.decode([i]) for i in range(size) if i not in special}
                self._token_texts = {i: t for i, t in texts.items() if t}
            return self._token_texts

    def matcher(self, grammar: Any) -> RegexMatcher:
        return RegexMatcher(grammar)
