"""``engine.logits_processors`` entry ``acme_no_repeat_ngram``: never repeat an n-gram.

A request asks for it with ``extra_args={"no_repeat_ngram_size": N}``: a token that would
complete an N-gram already present in its prompt and output so far gets ``-inf`` (as
transformers' ``no_repeat_ngram_size``). Requests without the key are untouched. Each
request's n-grams are indexed incrementally, so a step costs one lookup per request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.sdk.errors import ValidationError
from engine.sdk.logits_processor import (
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessorContext,
    process_dict_updates,
)
from engine.sdk.sampling_params import SamplingParams

KEY = "no_repeat_ngram_size"
MAX_NGRAM_SIZE = 32


def ngram_size_of(params: SamplingParams) -> int | None:
    """The request's N, or ``None`` when it does not use the processor."""
    size: int | None = (params.extra_args or {}).get(KEY)
    return size


def banned_tokens(sequence: Sequence[int], n: int) -> set[int]:
    """Tokens that would complete an ``n``-gram already in ``sequence`` (the reference)."""
    if len(sequence) < n:
        return set()
    tail = tuple(sequence[len(sequence) - n + 1:]) if n > 1 else ()
    return {sequence[i + n - 1] for i in range(len(sequence) - n + 1)
            if tuple(sequence[i:i + n - 1]) == tail}


@dataclass
class _Request:
    """One request's N, its prompt, its live output list and its n-gram index."""

    n: int
    prompt: tuple[int, ...]
    output: list[int]  # the engine's live list: read, never modified
    next_token: dict[tuple[int, ...], set[int]] = field(default_factory=dict)
    num_indexed: int = 0  # tokens of prompt + output whose n-gram is indexed

    def catch_up(self) -> None:
        """Index the n-grams ending at the tokens generated since the last call."""
        total = len(self.prompt) + len(self.output)
        n = self.n
        for end in range(max(self.num_indexed, n - 1), total):
            gram = [self._token(i) for i in range(end - n + 1, end + 1)]
            self.next_token.setdefault(tuple(gram[:-1]), set()).add(gram[-1])
        self.num_indexed = total

    def banned(self) -> set[int]:
        total = len(self.prompt) + len(self.output)
        if total < self.n - 1:
            return set()
        tail = tuple(self._token(i) for i in range(total - self.n + 1, total))
        return self.next_token.get(tail, set())

    def _token(self, index: int) -> int:
        return self.prompt[index] if index < len(self.prompt) else self.output[
            index - len(self.prompt)]


class NoRepeatNGram(LogitsProcessor):
    """Bans tokens that would repeat an n-gram; N = ``extra_args["no_repeat_ngram_size"]``."""

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        size = ngram_size_of(params)
        if size is None:
            return
        if type(size) is not int or not 1 <= size <= MAX_NGRAM_SIZE:
            raise ValidationError(
                f"{KEY} must be an integer in [1, {MAX_NGRAM_SIZE}], got {size!r}",
                param=f"extra_args.{KEY}")

    def __init__(self, ctx: LogitsProcessorContext) -> None:
        super().__init__(ctx)
        self.slot_to_request: dict[int, _Request] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # banning the top token changes the greedy choice

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.slot_to_request, batch_update, self._new_request)
        for request in self.slot_to_request.values():
            request.catch_up()

    @staticmethod
    def _new_request(params: SamplingParams, prompt_ids: tuple[int, ...] | None,
                     output_ids: list[int]) -> _Request | None:
        n = ngram_size_of(params)
        return None if n is None else _Request(n, tuple(prompt_ids or ()), output_ids)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        vocab_size = logits.shape[1]
        for slot, request in self.slot_to_request.items():
            banned = [t for t in request.banned() if t < vocab_size]
            if banned:
                logits[slot, banned] = float("-inf")
        return logits
