"""A prompt that cannot fit the context is refused before it is tokenized.

A 20 MB prompt (under ``--max-request-bytes``) used to be tokenized for ~27 s before its
400: now its length alone proves it cannot fit (``Tokenizer.min_num_tokens``), so the
tokenizer is never called for it (a spy on ``encode`` counts the calls), in completions
(``InputProcessor``), chat (``LLM.chat``; the server's path is tested with the server) and
``LLM.generate``. A prompt that fits is tokenized and served as before, and one too long
for the context but not provably so from its length gets the usual message.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.core import LLM
from engine.core.frontend.input_processor import InputProcessor
from engine.core.model_loader import resolve_model
from engine.core.tokenizer import Tokenizer, load_tokenizer
from engine.sdk import SamplingParams, ValidationError

HUGE = "All work and no play. " * (20_000_000 // 22)  # ~20 MB
MAX_MODEL_LEN = 64


def spy_on_encode(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The length of every text ``tokenizer.encode`` is called with, from now on."""
    calls: list[int] = []
    encode = tokenizer.encode

    def counting(text: str, *args: Any, **kwargs: Any) -> list[int]:
        calls.append(len(text))
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", counting)
    return calls


@pytest.fixture
def processor(tiny_llama: Path) -> InputProcessor:
    return InputProcessor(load_tokenizer(resolve_model(str(tiny_llama))),
                          max_model_len=MAX_MODEL_LEN, vocab_size=512, extra_args_plugins={})


@pytest.mark.parametrize("prompt", [HUGE, {"prompt": HUGE}], ids=["text", "dict"])
def test_a_20mb_prompt_is_refused_without_tokenizing(
        processor: InputProcessor, monkeypatch: pytest.MonkeyPatch, prompt: Any) -> None:
    calls = spy_on_encode(processor.tokenizer, monkeypatch)
    with pytest.raises(ValidationError) as info:
        processor.process("huge", prompt, SamplingParams())
    assert calls == []
    assert info.value.param == "prompt"
    limit = processor.tokenizer.max_chars_per_token
    assert limit == 5  # the test tokenizer: bytes, and '<unk>' the longest string
    assert str(info.value) == (
        f"the prompt has at least {-(-len(HUGE) // 5)} tokens ({len(HUGE)} characters, and "
        f"one token of this tokenizer stands for at most 5); this model's maximum context "
        f"length is {MAX_MODEL_LEN}, which leaves no room to generate")


def test_a_prompt_that_fits_is_tokenized_and_accepted(
        processor: InputProcessor, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = spy_on_encode(processor.tokenizer, monkeypatch)
    processed = processor.process("fits", "Once upon a time", SamplingParams(max_tokens=8))
    assert calls == [len("Once upon a time")]
    assert len(processed.prompt_token_ids) >= len("Once upon a time")


def test_a_prompt_too_long_but_not_provably_so_gets_the_usual_message(
        processor: InputProcessor, monkeypatch: pytest.MonkeyPatch) -> None:
    text = "x" * (MAX_MODEL_LEN * 2)  # at least 26 tokens by its length: it is tokenized
    calls = spy_on_encode(processor.tokenizer, monkeypatch)
    with pytest.raises(ValidationError, match=r"^the prompt has \d+ tokens; this model's "
                       r"maximum context length is 64, which leaves no room"):
        processor.process("long", text, SamplingParams())
    assert calls == [len(text)]


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> Iterator[LLM]:
    with LLM(str(tiny_llama), dtype="float32", in_process=True, num_kv_blocks=32,
             max_model_len=MAX_MODEL_LEN, plugins="none") as engine:
        yield engine


def test_offline_generate_and_chat_refuse_it_without_tokenizing(
        llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = spy_on_encode(llm.get_tokenizer(), monkeypatch)
    with pytest.raises(ValidationError, match="the prompt has at least") as info:
        llm.chat([{"role": "user", "content": HUGE}], use_tqdm=False)
    assert info.value.param == "messages"
    with pytest.raises(ValidationError, match="the prompt has at least") as info:
        llm.generate(HUGE, use_tqdm=False)
    assert info.value.param == "prompt"
    assert calls == []
    [reply] = llm.chat([{"role": "user", "content": "Hi"}],
                       SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(reply.outputs[0].token_ids) == 4
    assert len(calls) == 1  # the conversation that fits was tokenized once
