"""The front end refuses what the wire to EngineCore cannot carry, in every mode.

``seed`` (int64, ``seed + i`` per choice), ``top_k`` and ``priority`` (int32),
finite ``temperature``/``repetition_penalty``, and text without lone surrogates: each a
``ValidationError`` naming the field, before anything is queued.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.core.frontend.input_processor import InputProcessor
from engine.core.logits_processors import BUILTIN_LOGITS_PROCESSORS
from engine.core.model_loader import resolve_model
from engine.core.tokenizer import load_tokenizer
from engine.sdk import SamplingParams, ValidationError


@pytest.fixture(scope="module")
def processor(tiny_llama: Path) -> InputProcessor:
    return InputProcessor(load_tokenizer(resolve_model(str(tiny_llama))), max_model_len=64,
                          vocab_size=512,
                          extra_args_plugins={c.__name__: c for c in BUILTIN_LOGITS_PROCESSORS})


REFUSED: list[tuple[str, dict[str, Any], str, str]] = [
    # (prompt, params, param, text in the message)
    ("Hi", {"seed": 2**63}, "seed", "[-2^63, 9223372036854775807]"),
    ("Hi", {"seed": -(2**63) - 1}, "seed", "64-bit"),
    ("Hi", {"seed": 2**63 - 1, "n": 2}, "seed", "with n=2"),
    ("Hi", {"top_k": 2**31}, "top_k", "[0, 2147483647]"),
    ("Hi", {"temperature": float("inf")}, "temperature", "finite"),
    ("Hi", {"repetition_penalty": float("inf")}, "repetition_penalty", "finite"),
    ("Hi", {"stop": ["ok", "a\ud800"]}, "stop", "U+D800) at character 1"),
    ("ab\udfff", {}, "prompt", "lone UTF-16 surrogate (U+DFFF) at character 2"),
]


@pytest.mark.parametrize(("prompt", "fields", "param", "message"), REFUSED,
                         ids=[f"{c[2]}-{i}" for i, c in enumerate(REFUSED)])
def test_refused(processor: InputProcessor, prompt: str, fields: dict[str, Any], param: str,
                 message: str) -> None:
    with pytest.raises(ValidationError) as info:
        processor.process("r", prompt, SamplingParams(max_tokens=4, **fields))
    assert info.value.param == param
    assert message in str(info.value)


def test_priority_is_an_int32(processor: InputProcessor) -> None:
    with pytest.raises(ValidationError, match=r"\[-2147483648, 2147483647\]") as info:
        processor.process("r", "Hi", SamplingParams(max_tokens=4), priority=2**31)
    assert info.value.param == "priority"


def test_the_edges_are_accepted(processor: InputProcessor) -> None:
    done = processor.process("r", "Hi \U0001f600", SamplingParams(
        max_tokens=4, n=3, seed=2**63 - 3, top_k=2**31 - 1, stop=["\u00e9"]),
        priority=-(2**31))
    assert [c.sampling_params.seed for c in done.children] == [2**63 - 3, 2**63 - 2, 2**63 - 1]
    assert processor.process("r", "Hi", SamplingParams(seed=-(2**63))).children
