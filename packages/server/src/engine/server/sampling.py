"""From an HTTP request body to ``SamplingParams``, refusing what the engine cannot honour.

A field the engine cannot honour is a 400 that says so (never silently ignored): the
``UNSUPPORTED`` table lists the OpenAI fields that are accepted only at their neutral
value, with the reason shown to the client. ``user`` is accepted and ignored by design:
the engine keeps no per-user state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.core.model_loader.generation_config import GenerationDefaults
from engine.sdk.errors import ValidationError
from engine.sdk.sampling_params import SamplingParams
from engine.server.protocol import (
    MAX_N,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
)

_NO_FUNCTIONS = "the deprecated functions API is not supported; use tools and tool_choice"

#: field -> (neutral values, why anything else is refused).
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "suffix": ((None, ""), "insertion (suffix) is not supported"),
    "functions": ((None, []), _NO_FUNCTIONS),
    "function_call": ((None, "none"), _NO_FUNCTIONS),
    "audio": ((None,), "audio output is not supported"),
    "modalities": ((None, ["text"]), "only the text modality is supported"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "reasoning_effort": ((None,), "reasoning effort is not supported"),
    "web_search_options": ((None,), "web search is not supported"),
    "service_tier": ((None, "auto", "default"), "service tiers are not supported"),
    "store": ((None, False), "stored completions are not supported"),
    "metadata": ((None,), "metadata is only used with stored completions, which are not "
                          "supported"),
}


def check_supported(request: SamplingRequest) -> None:
    """Refuse fields the engine cannot honour.

    Raises:
        ValidationError: naming the field and saying why.
    """
    for name in request.model_fields_set:
        spec = UNSUPPORTED.get(name)
        if spec is None:
            continue
        neutral, reason = spec
        value = getattr(request, name)
        if not any(value == ok for ok in neutral):
            raise ValidationError(f"{name} is not supported by this server: {reason}",
                                  param=name)
    if isinstance(request, CompletionRequest) and request.best_of not in (None, request.n):
        raise ValidationError(f"best_of={request.best_of!r} is not supported: it must be "
                              f"omitted or equal to n ({request.n})", param="best_of")
    if request.stream_options is not None and not request.stream:
        raise ValidationError("stream_options needs stream: true", param="stream_options")
    if request.n > MAX_N:
        raise ValidationError(f"n must be at most {MAX_N}, got {request.n}", param="n")


def _extra_args(request: SamplingRequest) -> dict[str, Any] | None:
    if request.extra_args is None and request.vllm_xargs is None:
        return None
    merged = dict(request.vllm_xargs or {})
    for key, value in (request.extra_args or {}).items():
        if key in merged and merged[key] != value:
            raise ValidationError(f"extra_args and vllm_xargs give different values for "
                                  f"{key!r}; vllm_xargs is an alias, give one",
                                  param=f"extra_args.{key}")
        merged[key] = value
    return merged


#: Longer ``logit_bias`` keys cannot be a token id of any vocabulary (and int() of a
#: 5,000-digit string raises).
_MAX_TOKEN_ID_DIGITS = 18


def _logit_bias(bias: Mapping[str, float] | None) -> dict[int, float] | None:
    if bias is None:
        return None
    out = {}
    for key, value in bias.items():
        # Plain decimal digits only: int() would also take " 7", "+7", "1_0" and non-ASCII digits.
        if not (key.isascii() and key.isdigit()):
            raise ValidationError(f"logit_bias keys must be token ids (non-negative integers "
                                  f"written as decimal strings, e.g. \"50256\"), got {key!r}",
                                  param="logit_bias")
        if len(key) > _MAX_TOKEN_ID_DIGITS:
            raise ValidationError(f"logit_bias key {key[:20]}... ({len(key)} digits) is not a "
                                  f"token id: token ids are below the vocabulary size",
                                  param="logit_bias")
        out[int(key)] = value
    return out


def _check_logprobs(value: int | None, param: str) -> None:
    # The upper bound is the engine's --max-logprobs (checked by its input processor).
    if value is not None and value < 0:
        raise ValidationError(f"{param} must be an integer >= 0, got {value}", param=param)


def build_params(request: SamplingRequest, *, max_tokens: int | None, logprobs: int | None,
                 prompt_logprobs: int | None = None,
                 rename: Mapping[str, str] | None = None,
                 defaults: GenerationDefaults | None = None) -> SamplingParams:
    """``SamplingParams`` from the request's sampling fields.

    Args:
        request: The parsed body.
        max_tokens: The token cap (the endpoints name it differently).
        logprobs: Top logprobs per generated token, or None.
        prompt_logprobs: Top logprobs per prompt token (completions ``echo``), or None.
        rename: Engine parameter names to report under the request's names
            (``{"max_tokens": "max_completion_tokens"}``).
        defaults: The model's default sampling parameters (``--generation-config``) for
            the fields the request leaves unset (null).

    Raises:
        ValidationError: a value is out of range; ``param`` is the request's field name.
    """
    check_supported(request)
    stop = request.stop
    default = (defaults or GenerationDefaults()).get
    try:
        return SamplingParams(
            n=request.n,
            temperature=default("temperature", request.temperature, 1.0),
            top_p=default("top_p", request.top_p, 1.0),
            top_k=default("top_k", request.top_k, 0),
            min_p=default("min_p", request.min_p, 0.0),
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=default("repetition_penalty", request.repetition_penalty, 1.0),
            seed=request.seed, max_tokens=default("max_tokens", max_tokens, None),
            min_tokens=request.min_tokens,
            stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
            stop_token_ids=tuple(request.stop_token_ids or ()),
            ignore_eos=request.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            logit_bias=_logit_bias(request.logit_bias),
            skip_special_tokens=request.skip_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
            extra_args=_extra_args(request),
        )
    except ValidationError as exc:
        raise renamed(exc, rename) from None


def renamed(exc: ValidationError, rename: Mapping[str, str] | None) -> ValidationError:
    """``exc`` reported under the request's name for its parameter (unchanged if none)."""
    param = (rename or {}).get(exc.param or "")
    if param is None or exc.param is None:
        return exc
    # Field names (``max_tokens``) are renamed in the text too; plain words ("prompt") not.
    message = str(exc).replace(exc.param, param) if "_" in exc.param else str(exc)
    return ValidationError(message, param=param)


def completion_params(request: CompletionRequest,
                      defaults: GenerationDefaults | None = None) -> SamplingParams:
    """Sampling params of a completions request (``echo`` + ``logprobs`` adds prompt ones).

    ``defaults`` (``--generation-config``) fill the sampling fields the request leaves null.
    """
    _check_logprobs(request.logprobs, "logprobs")
    prompt_logprobs = request.logprobs if request.echo and request.logprobs is not None else None
    return build_params(request, max_tokens=request.max_tokens, logprobs=request.logprobs,
                        prompt_logprobs=prompt_logprobs, defaults=defaults)


def chat_renames(request: ChatCompletionRequest) -> dict[str, str]:
    """Engine parameter names -> the chat request's names for them."""
    rename = {"logprobs": "top_logprobs", "prompt": "messages"}
    if request.max_completion_tokens is not None:
        rename["max_tokens"] = "max_completion_tokens"
    return rename


def chat_params(request: ChatCompletionRequest,
                defaults: GenerationDefaults | None = None) -> SamplingParams:
    """Sampling params of a chat request (``max_completion_tokens`` wins over ``max_tokens``).

    ``defaults`` (``--generation-config``) fill the sampling fields the request leaves null.
    """
    _check_logprobs(request.top_logprobs, "top_logprobs")
    if request.top_logprobs is not None and not request.logprobs:
        raise ValidationError("top_logprobs needs logprobs: true", param="top_logprobs")
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    max_tokens = (request.max_tokens if request.max_completion_tokens is None
                  else request.max_completion_tokens)
    return build_params(request, max_tokens=max_tokens, logprobs=logprobs,
                        rename=chat_renames(request), defaults=defaults)
