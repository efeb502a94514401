"""``Tokenizer``: the engine's thin wrapper around a ``transformers`` fast tokenizer.

Why a wrapper: the engine needs a small, stable surface (encode, decode, ids <-> tokens, the
chat template) whose pieces agree with each other. ``transformers`` alone does not guarantee
that: its ``convert_ids_to_tokens(skip_special_tokens=True)`` skips only
``all_special_ids`` (bos/eos/unk/pad...), while ``decode(skip_special_tokens=True)`` skips
every added token flagged special (SmolLM2's ``<repo_name>``, ``<file_sep>``, ...). Here both
skip the same set (:attr:`Tokenizer.all_special_ids`), so incremental detokenization equals
a full decode.

``decode`` never applies ``clean_up_tokenization_spaces`` (which would also break that
equality); it decodes exactly what the tokens say.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jinja2
from tokenizers import Tokenizer as BackendTokenizer
from transformers import PreTrainedTokenizerBase

from engine.core.tokenizer.length_bound import max_chars_per_token
from engine.sdk.errors import UnsupportedError, ValidationError

NO_TEMPLATE_HINT = "pass one with --chat-template FILE"


class Tokenizer:
    """Encode, decode and render chat prompts for one model.

    Args:
        hf_tokenizer: A ``transformers`` fast tokenizer (one with ``backend_tokenizer``).
        chat_template: A Jinja chat template that replaces the tokenizer's own (the
            ``--chat-template`` override); ``None`` keeps the tokenizer's.

    Raises:
        UnsupportedError: ``hf_tokenizer`` is a slow (pure Python) tokenizer.
    """

    def __init__(
        self, hf_tokenizer: PreTrainedTokenizerBase, chat_template: str | None = None
    ) -> None:
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        if not isinstance(backend, BackendTokenizer):
            raise UnsupportedError(
                f"tokenizer {type(hf_tokenizer).__name__} is not a fast tokenizer; the engine "
                f"needs one backed by the `tokenizers` library (a tokenizer.json)"
            )
        self._hf = hf_tokenizer
        self._backend = backend
        self._chat_template = chat_template or getattr(hf_tokenizer, "chat_template", None)
        special = {int(i) for i in hf_tokenizer.all_special_ids}
        special.update(i for i, tok in backend.get_added_tokens_decoder().items() if tok.special)
        self._special_ids = frozenset(special)
        self._vocab_size = int(backend.get_vocab_size(with_added_tokens=True))

    # -- facts ------------------------------------------------------------------------------

    @property
    def hf_tokenizer(self) -> PreTrainedTokenizerBase:
        """The wrapped ``transformers`` tokenizer (escape hatch; prefer this class's methods)."""
        return self._hf

    @property
    def backend(self) -> BackendTokenizer:
        """The ``tokenizers.Tokenizer`` doing the work."""
        return self._backend

    @property
    def eos_token_id(self) -> int | None:
        """The end-of-sequence id, if the tokenizer has one."""
        value = self._hf.eos_token_id
        return None if value is None else int(value)

    @property
    def bos_token_id(self) -> int | None:
        """The begin-of-sequence id, if the tokenizer has one."""
        value = self._hf.bos_token_id
        return None if value is None else int(value)

    @property
    def vocab_size(self) -> int:
        """The number of token ids, added tokens included (may be below the model's vocab)."""
        return self._vocab_size

    def __len__(self) -> int:
        return self._vocab_size

    @property
    def all_special_ids(self) -> list[int]:
        """The ids that ``skip_special_tokens=True`` removes, sorted.

        The tokenizer's special tokens (bos, eos, unk, pad, ...) and every added token
        flagged special.
        """
        return sorted(self._special_ids)

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template in use (the override if one was given), or ``None``."""
        return self._chat_template

    # -- encode / decode --------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``.

        Args:
            text: The text. Special-token strings in it (``<|im_start|>``) become their ids.
            add_special_tokens: Add what the tokenizer adds around a sequence (e.g. BOS).
        """
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens))

    @functools.cached_property
    def max_chars_per_token(self) -> int | None:
        """The most characters of input one token can stand for; ``None``: no such bound.

        Derived from the tokenizer's pipeline (see
        :mod:`engine.core.tokenizer.length_bound`), once, on first use.
        """
        return max_chars_per_token(self._backend)

    def min_num_tokens(self, text: str) -> int:
        """A lower bound on ``len(self.encode(text))``, without tokenizing (0 if none is known).

        ``ceil(len(text) / max_chars_per_token)``: cheap, so a text far too long for the
        context can be refused before the (slow) tokenization.
        """
        limit = self.max_chars_per_token
        return 0 if limit is None else -(-len(text) // limit)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids`` (unknown ids are dropped; no whitespace clean-up)."""
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(
        self, ids: Iterable[int], skip_special_tokens: bool = False
    ) -> list[str]:
        """The vocabulary strings of ``ids``; an id outside the vocabulary gives ``""``."""
        out = []
        for token_id in ids:
            token_id = int(token_id)
            if skip_special_tokens and token_id in self._special_ids:
                continue
            out.append(self._backend.id_to_token(token_id) or "")
        return out

    def convert_tokens_to_string(self, tokens: Sequence[str]) -> str:
        """Join vocabulary strings into text with the tokenizer's decoder (byte-level, ...)."""
        decoder = self._backend.decoder
        return decoder.decode(list(tokens)) if decoder is not None else " ".join(tokens)

    def is_special_id(self, token_id: int) -> bool:
        """Whether ``skip_special_tokens=True`` removes ``token_id``."""
        return token_id in self._special_ids

    # -- chat -------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation to the prompt text, with the model's chat template.

        Rendering is ``transformers``' (a sandboxed Jinja environment with
        ``raise_exception``, ``strftime_now`` and the special tokens ``bos_token``,
        ``eos_token``, ... as variables).

        Args:
            messages: ``[{"role": ..., "content": ...}, ...]``.
            add_generation_prompt: End with the header that starts the assistant's turn.
            tools: Tool (function) schemas, for templates that render them.
            **template_kwargs: Extra template variables (e.g. ``enable_thinking``).

        Returns:
            The prompt text; encode it with ``add_special_tokens=False``: the template
            already wrote the special tokens it wants.

        Raises:
            ValidationError: There is no chat template, or the template rejected the
                messages (its ``raise_exception`` message is passed on) or a value it was
                given (a ``TypeError`` or ``ValueError`` while rendering).
        """
        if self._chat_template is None:
            raise ValidationError(
                f"this model's tokenizer has no chat template; {NO_TEMPLATE_HINT}",
                param="messages",
            )
        try:
            text = self._hf.apply_chat_template(
                [dict(m) for m in messages],
                tools=None if tools is None else [dict(t) for t in tools],
                chat_template=self._chat_template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **template_kwargs,
            )
        except jinja2.TemplateError as err:
            raise ValidationError(f"chat template error: {err}", param="messages") from err
        except (TypeError, ValueError) as err:  # the template met a value it cannot use
            raise ValidationError(f"chat template error: {type(err).__name__}: {err}",
                                  param="messages") from err
        return str(text)
