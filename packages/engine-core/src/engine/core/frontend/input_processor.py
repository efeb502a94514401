"""Validate and tokenize a request, and split ``n > 1`` into one engine request per choice.

Every check here happens before EngineCore sees the request, and every failure is a
``ValidationError`` naming the field (HTTP 400 in the server): the model's limits (context
length, vocabulary; a text so long that it cannot fit the context whatever its tokens is
refused before it is tokenized: :mod:`engine.core.tokenizer.length_bound`), what the wire
can carry (:mod:`engine.core.frontend.wire_limits`),
and the plugins' parameters (:mod:`engine.core.frontend.extra_args`: each logits
processor's ``validate_params``, and no ``extra_args`` key that no plugin takes).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

from engine.core.frontend.extra_args import ExtraArgsChecker
from engine.core.frontend.wire_limits import check_int32, check_text, check_wire_limits
from engine.core.tokenizer.tokenizer import Tokenizer
from engine.sdk.errors import ValidationError
from engine.sdk.plugin import Plugin
from engine.sdk.sampling_params import SamplingParams
from engine.sdk.scheduler import EngineRequest
from engine.sdk.structured_output import StructuredOutputsParams

#: A prompt: text, token ids, or ``{"prompt_token_ids": [...]}`` / ``{"prompt": "..."}``.
PromptType = Union[str, Sequence[int], Mapping[str, Any]]


@dataclass(frozen=True)
class ProcessedRequest:
    """A validated request: its prompt and the engine requests of its ``n`` choices."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    children: tuple[EngineRequest, ...]


def child_request_id(request_id: str, index: int) -> str:
    """Engine request id of choice ``index`` of ``request_id`` (as vLLM names them)."""
    return f"{index}_{request_id}"


class InputProcessor:
    """Tokenizes and validates prompts against the model's limits and the plugins."""

    def __init__(self, tokenizer: Tokenizer, *, max_model_len: int, vocab_size: int,
                 extra_args_plugins: Mapping[str, type[Plugin]],
                 max_logprobs: int = 20,
                 structured_outputs: Callable[[StructuredOutputsParams], None] | None = None,
                 ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        #: ``--max-logprobs``: most logprobs per token a request may ask for (-1: vocab).
        self.max_logprobs = vocab_size if max_logprobs == -1 else max_logprobs
        #: The loaded logits processors' ``validate_params`` and the ``extra_args`` keys the
        #: plugins the engine uses take (:mod:`engine.core.extra_args_keys`; EngineCore's
        #: are added once it is up).
        self.extra_args = ExtraArgsChecker(extra_args_plugins)
        #: Checks a request's structured-output spec (the backend's ``validate``).
        self.check_structured_outputs = structured_outputs

    def tokenize(self, prompt: PromptType) -> tuple[str | None, tuple[int, ...]]:
        """``(text or None, token ids)`` of a prompt in any accepted form."""
        if isinstance(prompt, str):
            check_text(prompt, "prompt")
            return prompt, self.encode_text(prompt)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                return self.tokenize(prompt["prompt"])
            raise ValidationError("a prompt dict needs 'prompt_token_ids' (a list of token "
                                  "ids) or 'prompt' (a string)", param="prompt")
        if isinstance(prompt, Sequence):
            return None, self._check_ids(prompt)
        raise ValidationError(f"a prompt must be a string, a list of token ids or a dict, got "
                              f"{type(prompt).__name__}", param="prompt")

    def encode_text(self, text: str, *, add_special_tokens: bool = True,
                    param: str = "prompt") -> tuple[int, ...]:
        """Token ids of ``text``, refused first if it cannot fit the context.

        A text whose token count is known, from its length alone, to leave no room to
        generate (``Tokenizer.min_num_tokens(text) >= max_model_len``) is refused without
        tokenizing it: a 20 MB prompt costs a length check, not half a minute of CPU.

        Args:
            text: A prompt, or a conversation rendered with the chat template.
            add_special_tokens: Add what the tokenizer adds around a sequence (BOS); False
                for a rendered conversation.
            param: The request field named by the error (``"messages"`` for chat).

        Raises:
            ValidationError: the text cannot fit the context (as ``validate_params`` says
                of a prompt that leaves no room to generate).
        """
        if len(text) >= self.max_model_len:  # a shorter text has fewer tokens than that
            at_least = self.tokenizer.min_num_tokens(text)
            if at_least >= self.max_model_len:
                raise ValidationError(
                    f"the prompt has at least {at_least} tokens ({len(text)} characters, and "
                    f"one token of this tokenizer stands for at most "
                    f"{self.tokenizer.max_chars_per_token}); this model's maximum context "
                    f"length is {self.max_model_len}, which leaves no room to generate",
                    param=param)
        return tuple(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def _check_ids(self, ids: Any) -> tuple[int, ...]:
        if not isinstance(ids, Sequence) or isinstance(ids, str):
            raise ValidationError("prompt token ids must be a list of integers", param="prompt")
        for token in ids:
            if isinstance(token, bool) or not isinstance(token, int):
                raise ValidationError(f"prompt token ids must be integers, got {token!r}",
                                      param="prompt")
            if not 0 <= token < self.vocab_size:
                raise ValidationError(f"prompt token id {token} is out of range; the "
                                      f"vocabulary has {self.vocab_size} tokens",
                                      param="prompt")
        return tuple(ids)

    def validate_params(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        """Check the params against the model and plugins; fill ``max_tokens`` if None."""
        if num_prompt_tokens == 0:
            raise ValidationError("the prompt is empty; give at least one token",
                                  param="prompt")
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise ValidationError(
                f"the prompt has {num_prompt_tokens} tokens; this model's maximum context "
                f"length is {self.max_model_len}, which leaves no room to generate",
                param="prompt")
        if params.max_tokens is None:
            params = params.replace(max_tokens=room)
        elif params.max_tokens > room:
            raise ValidationError(
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"request asks for {num_prompt_tokens + params.max_tokens} "
                f"({num_prompt_tokens} in the prompt, {params.max_tokens} to generate). "
                f"Lower max_tokens to at most {room}.", param="max_tokens")
        for token in list(params.logit_bias or ()) + list(params.stop_token_ids):
            if token >= self.vocab_size:
                raise ValidationError(f"token id {token} is out of range; the vocabulary has "
                                      f"{self.vocab_size} tokens",
                                      param="logit_bias" if token in (params.logit_bias or {})
                                      else "stop_token_ids")
        check_wire_limits(params)
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and asked > self.max_logprobs:
                raise ValidationError(
                    f"{name} must be in [0, {self.max_logprobs}] (the most logprobs per token "
                    f"this engine returns, --max-logprobs), got {asked}", param=name)
        self.extra_args.check(params)
        if params.structured_outputs is not None:
            if self.check_structured_outputs is None:
                raise ValidationError("structured outputs are not available in this engine",
                                      param="structured_outputs")
            self.check_structured_outputs(params.structured_outputs)
        return params

    def process(
        self, request_id: str, prompt: PromptType, params: SamplingParams, *,
        arrival_time: float | None = None, priority: int = 0,
    ) -> ProcessedRequest:
        """Validate and tokenize; one ``EngineRequest`` per choice (seeds ``seed + i``)."""
        check_int32(priority, "priority", low=-(2**31))
        text, ids = self.tokenize(prompt)
        params = self.validate_params(params, len(ids))
        arrival = time.time() if arrival_time is None else arrival_time
        children = []
        for index in range(params.n):
            seed = None if params.seed is None else params.seed + index
            # Prompt logprobs are the same for every choice: only the first computes them.
            child = params.replace(n=1, seed=seed,
                                   prompt_logprobs=params.prompt_logprobs if index == 0 else None)
            children.append(EngineRequest(
                request_id=child_request_id(request_id, index), prompt_token_ids=ids,
                sampling_params=child, eos_token_id=self.tokenizer.eos_token_id,
                arrival_time=arrival, priority=priority,
            ))
        return ProcessedRequest(request_id, text, ids, params, tuple(children))
