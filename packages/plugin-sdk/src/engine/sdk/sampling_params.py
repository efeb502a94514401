"""``SamplingParams``: how one request is sampled, validated where it is built.

The same object travels from the front end (where it is built from the HTTP request or the
``LLM.generate`` call) to EngineCore and the workers, and reaches plugins through
``BatchUpdate.added`` (logits processors) and the request views (schedulers). Parameters
for plugins travel in :attr:`SamplingParams.extra_args` (HTTP field ``extra_args``, or
``vllm_xargs`` as vLLM clients send it).

.. versionadded:: 1.0
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.sdk.errors import ValidationError
from engine.sdk.structured_output import StructuredOutputsParams

#: ``temperature`` at or below this value means greedy sampling.
GREEDY_TEMPERATURE = 1e-5


def _require(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ValidationError(f"{param} {message}", param=param)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Sampling parameters of one request (vLLM-compatible names and defaults).

    Every field is validated on construction; a bad value raises
    :class:`~engine.sdk.errors.ValidationError` whose ``param`` is the field name and whose
    message says the allowed range. Use :meth:`replace` to derive a modified copy.

    Attributes:
        n: Number of completions for the prompt (>= 1). They share the prompt's KV blocks.
        temperature: >= 0; 0 means greedy (argmax).
        top_p: Nucleus sampling mass, in (0, 1]; 1 disables it.
        top_k: Keep the k most likely tokens; 0 (or -1) disables it.
        min_p: Drop tokens whose probability is below ``min_p`` times the top one's; in [0, 1].
        presence_penalty: In [-2, 2]; subtracted once from every token already generated.
        frequency_penalty: In [-2, 2]; subtracted per occurrence in the generated tokens.
        repetition_penalty: > 0; 1 disables it. Divides positive logits (multiplies negative
            ones) of tokens seen in the prompt or the output.
        seed: Per-request seed: the same seed gives the same tokens whatever else is in the batch.
        max_tokens: Tokens to generate at most (>= 1); ``None`` means up to the context length.
        min_tokens: EOS and stop token ids are suppressed until this many tokens exist.
        stop: Strings that end generation; they are not included in the text. Given as
            one string or any sequence of them (a list), kept as a tuple.
        stop_token_ids: Token ids that end generation (kept in ``token_ids``). Given as any
            sequence, kept as a tuple.
        ignore_eos: Keep generating past EOS (benchmarks).
        logprobs: Return the log-probabilities of the sampled token and this many top tokens
            at each step (>= 0); ``None`` returns none.
        prompt_logprobs: The same for every prompt token; ``None`` returns none.
        logit_bias: ``{token_id: bias}`` added to the logits, bias in [-100, 100].
        skip_special_tokens: Leave special tokens out of the detokenized text.
        include_stop_str_in_output: Keep the matched stop string in the text.
        extra_args: Free-form parameters for plugins (logits processors read theirs here and
            validate them in ``validate_params``). Values must be JSON-serialisable.
        structured_outputs: Constrain the output to a JSON schema, a regex, a choice or a
            grammar (:class:`~engine.sdk.structured_output.StructuredOutputsParams`, or a
            mapping of its fields, e.g. ``{"choice": ["yes", "no"]}``, turned into one);
            ``None`` leaves the output free.

    .. versionadded:: 1.0
    .. versionchanged:: 1.1 Added ``structured_outputs``.
    .. versionchanged:: 1.1 The constructor's types say what it has always accepted:
       ``stop`` as one string or any sequence, ``stop_token_ids`` as any sequence (both
       kept as tuples), ``structured_outputs`` as a mapping too. Attributes unchanged.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: Mapping[int, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    extra_args: Mapping[str, Any] | None = field(default=None, compare=True)
    structured_outputs: StructuredOutputsParams | None = None

    if TYPE_CHECKING:  # what the constructor accepts; __post_init__ normalises it
        def __init__(
            self, *, n: int = 1, temperature: float = 1.0, top_p: float = 1.0,
            top_k: int = 0, min_p: float = 0.0, presence_penalty: float = 0.0,
            frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
            seed: int | None = None, max_tokens: int | None = 16, min_tokens: int = 0,
            stop: str | Sequence[str] = (), stop_token_ids: Sequence[int] = (),
            ignore_eos: bool = False, logprobs: int | None = None,
            prompt_logprobs: int | None = None, logit_bias: Mapping[int, float] | None = None,
            skip_special_tokens: bool = True, include_stop_str_in_output: bool = False,
            extra_args: Mapping[str, Any] | None = None,
            structured_outputs: StructuredOutputsParams | Mapping[str, Any] | None = None,
        ) -> None:
            """Validate the fields and normalise them (see the class docstring).

            For type checkers only: at run time the dataclass's own ``__init__`` runs,
            with these parameters and defaults.

            .. versionchanged:: 1.1 Added ``structured_outputs``; ``stop``,
               ``stop_token_ids`` and ``structured_outputs`` typed as accepted.
            """

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, Mapping):
            object.__setattr__(self, "structured_outputs",
                               StructuredOutputsParams.from_dict(self.structured_outputs))
        # Normalise sequences given as lists (or a single stop string) into tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, Sequence):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.stop_token_ids, Sequence):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        _require(_is_int(self.n) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        for name, low, high in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0)):
            value = getattr(self, name)
            _require(_is_number(value) and low <= value <= high, name,
                     f"must be a number in [{low:g}, {high:g}], got {value!r}")
        _require(_is_number(self.temperature) and self.temperature >= 0, "temperature",
                 f"must be a number >= 0 (0 means greedy), got {self.temperature!r}")
        _require(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p",
                 f"must be a number in (0, 1], got {self.top_p!r}")
        _require(_is_int(self.top_k) and self.top_k >= 0, "top_k",
                 f"must be an integer >= 0 (0 or -1 disables it), got {self.top_k!r}")
        _require(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p",
                 f"must be a number in [0, 1], got {self.min_p!r}")
        _require(_is_number(self.repetition_penalty) and self.repetition_penalty > 0,
                 "repetition_penalty", f"must be a number > 0 (1 disables it), got "
                 f"{self.repetition_penalty!r}")
        _require(self.seed is None or _is_int(self.seed), "seed",
                 f"must be an integer or null, got {self.seed!r}")
        _require(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
                 "max_tokens", f"must be an integer >= 1 or null, got {self.max_tokens!r}")
        _require(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens",
                 f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None:
            _require(self.min_tokens <= self.max_tokens, "min_tokens",
                     f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _require(all(isinstance(s, str) and s for s in self.stop), "stop",
                 "must be a non-empty string or a list of non-empty strings, got "
                 f"{list(self.stop)!r}")
        _require(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
                 f"must be a list of token ids (integers >= 0), got {list(self.stop_token_ids)!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _require(value is None or (_is_int(value) and value >= 0), name,
                     f"must be an integer >= 0 or null, got {value!r}")
        if self.logit_bias is not None:
            _require(isinstance(self.logit_bias, Mapping), "logit_bias",
                     f"must be a mapping of token id to bias, got {type(self.logit_bias).__name__}")
            for token, bias in self.logit_bias.items():
                _require(_is_int(token) and token >= 0, "logit_bias",
                         f"keys must be token ids (integers >= 0), got {token!r}")
                _require(_is_number(bias) and -100 <= bias <= 100, "logit_bias",
                         f"values must be numbers in [-100, 100], got {bias!r} for token {token}")
        _require(self.extra_args is None or isinstance(self.extra_args, Mapping), "extra_args",
                 f"must be a mapping of string keys to values, got {self.extra_args!r}")
        _require(self.structured_outputs is None
                 or isinstance(self.structured_outputs, StructuredOutputsParams),
                 "structured_outputs", "must be a StructuredOutputsParams or a mapping of its "
                 f"fields, got {self.structured_outputs!r}")

    @property
    def is_greedy(self) -> bool:
        """True when the request takes the argmax at every step."""
        return self.temperature <= GREEDY_TEMPERATURE

    def replace(self, **changes: Any) -> SamplingParams:
        """A validated copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable fields, the inverse of :meth:`from_dict`."""
        out = dataclasses.asdict(self)
        out["stop"] = list(self.stop)
        out["stop_token_ids"] = list(self.stop_token_ids)
        if self.logit_bias is not None:
            out["logit_bias"] = {str(k): v for k, v in self.logit_bias.items()}
        if self.extra_args is not None:
            out["extra_args"] = dict(self.extra_args)
        if self.structured_outputs is not None:
            out["structured_outputs"] = self.structured_outputs.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SamplingParams:
        """Build from :meth:`to_dict` output; unknown keys are a ValidationError naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValidationError(
                f"unknown sampling parameter(s) {', '.join(unknown)}; allowed: "
                f"{', '.join(sorted(known))}",
                param=unknown[0],
            )
        values = dict(data)
        bias = values.get("logit_bias")
        if isinstance(bias, Mapping):
            try:
                values["logit_bias"] = {int(k): v for k, v in bias.items()}
            except (TypeError, ValueError):
                raise ValidationError(
                    "logit_bias keys must be token ids (integers)", param="logit_bias"
                ) from None
        return cls(**values)
