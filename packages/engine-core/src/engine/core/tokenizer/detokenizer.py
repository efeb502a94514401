"""Incremental detokenization: turn a stream of token ids into a stream of text deltas.

Decoding token by token is wrong in two ways: a character spread over several byte-level
tokens (an emoji is often 2-3 tokens) would come out as U+FFFD halves, and decoders that
drop a leading space on the first token of a decode call (SentencePiece's metaspace) would
glue words together. vLLM's answer, used here, decodes a short sliding window instead::

    tokens:  ... p0 p1 p2 p3 p4 | n0 n1 n2
                 ^prefix_offset  ^read_offset
    prefix_text = decode(tokens[prefix_offset:read_offset])   # already emitted
    new_text    = decode(tokens[prefix_offset:])               # emitted + pending
    delta       = new_text[len(prefix_text):]

The window starts a few tokens back (initially the last 5 of the prompt), so the decoder
sees the context a full decode would. While ``new_text`` ends with U+FFFD (an incomplete
UTF-8 sequence), nothing is emitted and the offsets stay: the next token may complete the
character. Once a delta is emitted the window slides: ``prefix_offset`` moves to the old
``read_offset`` and ``read_offset`` to the end.

Invariant (tested): for a prompt that ends on a character boundary,
``"".join(step(...) for each chunk) + flush() == tokenizer.decode(output_ids,
skip_special_tokens)``. :meth:`IncrementalDetokenizer.flush` releases text held back at the
end (an incomplete character, rendered as U+FFFD as a full decode would).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.core.tokenizer.tokenizer import Tokenizer

INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5
"""How many prompt tokens the first window reaches back (vLLM's value)."""

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text deltas for one request's output tokens.

    Args:
        tokenizer: The model's tokenizer.
        prompt_token_ids: The prompt; its last few tokens seed the decode window.
        skip_special_tokens: Leave special tokens (see ``Tokenizer.all_special_ids``) out of
            the text.
        spaces_between_special_tokens: Accepted for vLLM compatibility. Fast tokenizers (the
            only kind the engine loads) never put spaces between special tokens, so this
            has no effect.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        window = list(prompt_token_ids[-(INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET + 2) :])
        self._tokens = tokenizer.convert_ids_to_tokens(window, skip_special_tokens)
        self._read_offset = len(self._tokens)
        self._prefix_offset = max(self._read_offset - INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET, 0)
        self._output_text: list[str] = []

    @property
    def output_text(self) -> str:
        """All text emitted so far (the concatenation of every delta returned)."""
        text = "".join(self._output_text)
        self._output_text = [text]
        return text

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Add newly generated tokens; return the text they complete.

        Args:
            new_token_ids: The ids generated since the last call (usually one).

        Returns:
            The new text, possibly ``""`` (a character still incomplete, or a skipped
            special token).
        """
        tokens = self.tokenizer.convert_ids_to_tokens(new_token_ids, self.skip_special_tokens)
        if not tokens:
            return ""
        self._tokens.extend(tokens)
        prefix_text, new_text = self._decode_window()
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        return self._emit(new_text[len(prefix_text) :])

    def flush(self) -> str:
        """Return the text still held back (call once, when the request finishes).

        Held-back text is an incomplete character at the end of the output; it comes out
        as U+FFFD, as in ``tokenizer.decode``.
        """
        prefix_text, new_text = self._decode_window()
        if len(new_text) <= len(prefix_text):
            return ""
        return self._emit(new_text[len(prefix_text) :])

    def _decode_window(self) -> tuple[str, str]:
        window = self._tokens[self._prefix_offset :]
        prefix_text = self.tokenizer.convert_tokens_to_string(
            window[: self._read_offset - self._prefix_offset]
        )
        return prefix_text, self.tokenizer.convert_tokens_to_string(window)

    def _emit(self, delta: str) -> str:
        # Slide the window, and drop the tokens before it: they are never decoded again.
        del self._tokens[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self._output_text.append(delta)
        return delta
