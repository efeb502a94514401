"""IncrementalDetokenizer with the SmolLM2 tokenizer: streamed deltas equal a full decode."""

from __future__ import annotations

import random

import pytest

from engine.core.model_loader import resolve_model
from engine.core.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer

REAL_TEXTS = [
    "Hello world! How are you today?",
    "Emoji: 😀👍🏽 👩‍👩‍👧‍👦 and flags 🇯🇵🇫🇷, done.",
    "日本語のテキストと中文混合, 한국어도.",
    "def f(x):\n    return x ** 2  # squared\n\n\tindented\ttabs",
    "   multiple   spaces   ",
    "Ünïcödé çàfé — \u201cquotes\u201d \u2018single\u2019 \u2026 ellipsis",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(resolve_model(None))


@pytest.fixture(scope="module")
def prompt(tokenizer: Tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Say something."}])
    return tokenizer.encode(text, add_special_tokens=False)


def stream(
    detok: IncrementalDetokenizer, ids: list[int], rng: random.Random | None = None
) -> list[str]:
    deltas, i = [], 0
    while i < len(ids):
        size = 1 if rng is None else rng.choice([1, 1, 1, 2, 3, 7])
        deltas.append(detok.step(ids[i : i + size]))
        i += size
    return deltas


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_equal_full_decode(
    tokenizer: Tokenizer, prompt: list[int], skip_special_tokens: bool
) -> None:
    rng = random.Random(1234 + skip_special_tokens)
    num_ids = 0
    for trial in range(150):
        length = rng.randint(1, 60)
        ids = [
            rng.randrange(17) if rng.random() < 0.05 else rng.randrange(tokenizer.vocab_size)
            for _ in range(length)
        ]
        num_ids += length
        # Random prompts too, cut at a character boundary (re-encoded text).
        this_prompt = prompt if trial % 2 else tokenizer.encode(f"Prompt {trial}: ü😀")
        detok = IncrementalDetokenizer(tokenizer, this_prompt, skip_special_tokens)
        deltas = stream(detok, ids, rng if trial % 3 else None)
        tail = detok.flush()
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) + tail == expected, ids
        assert detok.output_text == expected
        assert detok.flush() == ""
    assert num_ids > 4000


@pytest.mark.parametrize("text", REAL_TEXTS)
def test_real_text_round_trip_never_splits_characters(
    tokenizer: Tokenizer, prompt: list[int], text: str
) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=True)
    deltas = stream(detok, ids)
    assert "".join(deltas) == text
    assert detok.flush() == ""
    assert not any("\ufffd" in d for d in deltas)


def test_multi_token_character_waits_for_its_last_token(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("a😀", add_special_tokens=False)
    emoji_ids = ids[1:]
    assert len(emoji_ids) >= 2  # byte-level BPE splits this emoji
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("x"))
    assert detok.step(ids[:1]) == "a"
    assert [detok.step([i]) for i in emoji_ids[:-1]] == [""] * (len(emoji_ids) - 1)
    assert detok.step(emoji_ids[-1:]) == "😀"


def test_incomplete_character_is_flushed_as_replacement(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("a😀", add_special_tokens=False)[:-1]
    detok = IncrementalDetokenizer(tokenizer, [])
    assert "".join(stream(detok, ids)) == "a"
    tail = detok.flush()
    assert tail.startswith("\ufffd")
    assert "a" + tail == tokenizer.decode(ids)


def test_spaces_and_special_tokens(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("Hello")
    world = tokenizer.encode(" world", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    assert detok.step(world) == " world"
    assert detok.step([tokenizer.eos_token_id or 0]) == ""  # skipped
    keep = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=False)
    assert keep.step([*world, 2]) == " world<|im_end|>"
    assert IncrementalDetokenizer(tokenizer, []).step([10**7]) == ""  # unknown id: no text


def test_empty_prompt_and_empty_step(tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok.step([]) == ""
    ids = tokenizer.encode(" leading space", add_special_tokens=False)
    assert "".join(stream(detok, ids)) == " leading space"
