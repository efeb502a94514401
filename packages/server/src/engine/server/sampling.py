"""From an HTTP request body to ``SamplingParams``, refusing what the engine cannot honour.

A field the engine cannot honour is a 400 that says so (never silently ignored): the
``UNSUPPORTED`` table lists the OpenAI fields that are accepted only at their neutral
value, with the reason shown to the client. ``user`` is accepted and ignored by design:
the engine keeps no per-user state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.sdk.errors import ValidationError
from engine.sdk.sampling_params import SamplingParams
from engine.server.protocol import (
    MAX_LOGPROBS,
    MAX_N,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
)

_NO_TOOLS = "this server does not do tool or function calling"

#: field -> (neutral values, why anything else is refused).
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "suffix": ((None, ""), "insertion (suffix) is not supported"),
    "tools": ((None, []), _NO_TOOLS),
    "tool_choice": ((None, "none"), _NO_TOOLS),
    "parallel_tool_calls": ((None,), _NO_TOOLS),
    "functions": ((None, []), _NO_TOOLS),
    "function_call": ((None, "none"), _NO_TOOLS),
    "response_format": ((None, {"type": "text"}),
                        "structured output (json_object, json_schema) is not supported; only "
                        "{\"type\": \"text\"}"),
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


def _logit_bias(bias: Mapping[str, float] | None) -> dict[int, float] | None:
    if bias is None:
        return None
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise ValidationError(f"logit_bias keys must be token ids (integers as strings), "
                                  f"got {key!r}", param="logit_bias") from None
    return out


def _check_logprobs(value: int | None, param: str) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise ValidationError(f"{param} must be in [0, {MAX_LOGPROBS}], got {value}",
                              param=param)


def build_params(request: SamplingRequest, *, max_tokens: int | None, logprobs: int | None,
                 prompt_logprobs: int | None = None,
                 rename: Mapping[str, str] | None = None) -> SamplingParams:
    """``SamplingParams`` from the request's sampling fields.

    Args:
        request: The parsed body.
        max_tokens: The token cap (the endpoints name it differently).
        logprobs: Top logprobs per generated token, or None.
        prompt_logprobs: Top logprobs per prompt token (completions ``echo``), or None.
        rename: Engine parameter names to report under the request's names
            (``{"max_tokens": "max_completion_tokens"}``).

    Raises:
        ValidationError: a value is out of range; ``param`` is the request's field name.
    """
    check_supported(request)
    stop = request.stop
    try:
        return SamplingParams(
            n=request.n,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=request.top_k or 0, min_p=request.min_p or 0.0,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=(1.0 if request.repetition_penalty is None
                                else request.repetition_penalty),
            seed=request.seed, max_tokens=max_tokens, min_tokens=request.min_tokens,
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


def completion_params(request: CompletionRequest) -> SamplingParams:
    """Sampling params of a completions request (``echo`` + ``logprobs`` adds prompt ones)."""
    _check_logprobs(request.logprobs, "logprobs")
    prompt_logprobs = request.logprobs if request.echo and request.logprobs is not None else None
    return build_params(request, max_tokens=request.max_tokens, logprobs=request.logprobs,
                        prompt_logprobs=prompt_logprobs)


def chat_renames(request: ChatCompletionRequest) -> dict[str, str]:
    """Engine parameter names -> the chat request's names for them."""
    rename = {"logprobs": "top_logprobs", "prompt": "messages"}
    if request.max_completion_tokens is not None:
        rename["max_tokens"] = "max_completion_tokens"
    return rename


def chat_params(request: ChatCompletionRequest) -> SamplingParams:
    """Sampling params of a chat request (``max_completion_tokens`` wins over ``max_tokens``)."""
    _check_logprobs(request.top_logprobs, "top_logprobs")
    if request.top_logprobs is not None and not request.logprobs:
        raise ValidationError("top_logprobs needs logprobs: true", param="top_logprobs")
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    max_tokens = (request.max_tokens if request.max_completion_tokens is None
                  else request.max_completion_tokens)
    return build_params(request, max_tokens=max_tokens, logprobs=logprobs,
                        rename=chat_renames(request))
