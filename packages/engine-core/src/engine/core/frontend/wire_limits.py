r"""What a request must fit to cross the wire to EngineCore and the workers.

``SamplingParams`` (SDK) checks what each value means (``top_k >= 0``); this module checks
what ``proto/engine/v1/engine_core.proto`` and the sampler can carry. The checks run in
every mode, in-process too, so a request never works in one mode and fails in another:

============================  ================================================================
``seed``                      int64; choice *i* of ``n`` uses ``seed + i``, so every one of
                              ``seed .. seed + n - 1`` must lie in [-2^63, 2^63 - 1]
``top_k``, ``priority``       int32: at most 2^31 - 1
``temperature``,              finite (the SDK bounds the other floats to ranges already)
``repetition_penalty``
text (prompt, ``stop``)       valid Unicode: a lone UTF-16 surrogate (JSON ``"\ud800"``)
                              has no UTF-8 encoding, so neither the tokenizer nor the wire
                              can carry it
============================  ================================================================

``max_tokens`` and ``min_tokens`` are bounded by the context length, ``logprobs`` by
``--max-logprobs``, token ids (prompt, ``stop_token_ids``, ``logit_bias``) by the
vocabulary, in :class:`~engine.core.frontend.input_processor.InputProcessor`.
"""

from __future__ import annotations

import math
import re

from engine.sdk.errors import ValidationError
from engine.sdk.sampling_params import SamplingParams

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate_at(text: str) -> int | None:
    r"""Index of the first lone UTF-16 surrogate in ``text``; None when it is valid Unicode.

    (A JSON decoder joins a valid ``\ud83d\ude00`` pair into one character, so every
    surrogate left in a ``str`` is a lone one.)
    """
    if text.isascii():
        return None
    match = _SURROGATE.search(text)
    return None if match is None else match.start()


def describe_surrogate(text: str, index: int) -> str:
    """Why ``text`` (with a lone surrogate at ``index``) is refused, and what is allowed."""
    return (f"holds a lone UTF-16 surrogate (U+{ord(text[index]):04X}) at character {index}, "
            f"which is not valid Unicode; send valid UTF-8 text (an escape \\uD800-\\uDBFF "
            f"must be followed by one in \\uDC00-\\uDFFF)")


def check_text(text: str, param: str) -> None:
    """Refuse ``text`` if it holds a lone surrogate.

    Raises:
        ValidationError: naming ``param`` and the position.
    """
    index = lone_surrogate_at(text)
    if index is not None:
        raise ValidationError(f"{param} {describe_surrogate(text, index)}", param=param)


def check_int32(value: int | None, param: str, low: int = 0) -> None:
    """Refuse an int32 field outside ``[low, 2^31 - 1]`` (None passes).

    ``low`` is the field's own lower bound (0 for counts; -2^31 for ``priority``).
    """
    if value is not None and not low <= value <= INT32_MAX:
        raise ValidationError(f"{param} must be an integer in [{low}, {INT32_MAX}] (a 32-bit "
                              f"integer), got {value}", param=param)


def check_seed(seed: int | None, n: int) -> None:
    """Refuse a seed whose choices' seeds ``seed .. seed + n - 1`` leave int64."""
    if seed is None:
        return
    if not INT64_MIN <= seed <= INT64_MAX - (n - 1):
        most = INT64_MAX - (n - 1)
        with_n = f" with n={n} (choice i uses seed + i)" if n > 1 else ""
        raise ValidationError(f"seed must be a 64-bit integer in [-2^63, {most}]{with_n}, "
                              f"got {seed}", param="seed")


def check_wire_limits(params: SamplingParams) -> None:
    """Refuse parameters the wire or the sampler cannot carry (see the module docstring).

    Raises:
        ValidationError: ``param`` names the field; the message gives the allowed range.
    """
    check_seed(params.seed, params.n)
    check_int32(params.top_k, "top_k")
    for name in ("temperature", "repetition_penalty"):
        value = getattr(params, name)
        if not math.isfinite(value):
            raise ValidationError(f"{name} must be a finite number, got {value!r}", param=name)
    for stop in params.stop:
        check_text(stop, "stop")
