"""``max_chars_per_token``: a lower bound on the token count that holds, or no bound at all.

For tokenizers whose pipeline keeps the argument of :mod:`engine.core.tokenizer.length_bound`
(byte-level BPE, sentencepiece-style BPE with byte fallback, NFC-normalizing byte-level),
texts built to make tokens as long as possible (whitespace runs, repeats, special-token
strings, combining sequences that NFC composes, Hangul jamo) never encode to fewer tokens
than the bound. Pipelines that can drop or fuse characters get no bound.
"""

from __future__ import annotations

import math
import random
import unicodedata

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers.trainers import BpeTrainer

from engine.core.tokenizer.length_bound import MAX_COMPOSED, max_chars_per_token

CORPUS = ["hello world " * 20, " " * 64 + "x", "=" * 80, "aaaa bbbb " * 30, "\n\n\n" * 10,
          "naïve café " * 10, "한국어 텍스트 " * 10, "def f(x):\n    return x\n" * 10]
SPECIALS = ["<|im_start|>", "<|im_end|>"]


def _trained(tokenizer: Tokenizer, **trainer: object) -> Tokenizer:
    options: dict[str, object] = {"special_tokens": SPECIALS, **trainer}
    tokenizer.train_from_iterator(CORPUS, BpeTrainer(vocab_size=400, show_progress=False,
                                                     **options))
    return tokenizer


def byte_level(normalizer: normalizers.Normalizer | None = None) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return _trained(tokenizer, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())


def sentencepiece_like() -> Tokenizer:
    """Llama 2's shape: Prepend + Replace(' ', '▁'), BPE with byte fallback, fuse_unk."""
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    return _trained(tokenizer, special_tokens=["<unk>", *SPECIALS, *byte_tokens])


SAFE = {"byte-level BPE": byte_level, "NFC byte-level BPE": lambda: byte_level(normalizers.NFC()),
        "NFKC lowercase byte-level BPE": lambda: byte_level(normalizers.Sequence(
            [normalizers.NFKC(), normalizers.Lowercase()])),
        "sentencepiece-style BPE": sentencepiece_like}


def hard_texts(rng: random.Random) -> list[str]:
    """Texts whose tokens are as long as this vocabulary allows, and odd Unicode."""
    pieces = ["=" * 80, " " * 64, "hello world ", "\n\n\n", "<|im_start|>", "<|im_end|>",
              "a\u0323\u0302", "\u1100\u1161\u11a8", "\u1f00\u0345", "ﬁ", "İ", "x"]
    texts = [piece * 500 for piece in pieces]
    texts.append("".join(rng.choice(pieces) for _ in range(2000)))
    texts.append("".join(chr(rng.randrange(32, 0x2FFFF)) for _ in range(3000))
                 .encode("utf-8", "ignore").decode("utf-8"))
    return texts


@pytest.mark.parametrize("name", sorted(SAFE))
def test_no_text_encodes_to_fewer_tokens_than_the_bound(name: str) -> None:
    tokenizer = SAFE[name]()
    limit = max_chars_per_token(tokenizer)
    assert limit is not None
    for text in hard_texts(random.Random(name)):
        num_tokens = len(tokenizer.encode(text, add_special_tokens=False).ids)
        assert num_tokens >= math.ceil(len(text) / limit), (name, text[:40], num_tokens)


def test_the_bound_is_the_longest_token_times_what_the_normalizer_may_compose() -> None:
    plain = byte_level()
    longest = max(len(token) for token in plain.get_vocab(with_added_tokens=True))
    assert longest >= 64  # the corpus' whitespace and '=' runs became long tokens
    assert max_chars_per_token(plain) == longest
    nfc = byte_level(normalizers.NFC())
    assert max_chars_per_token(nfc) == MAX_COMPOSED * max(
        len(token) for token in nfc.get_vocab(with_added_tokens=True))


def test_max_composed_is_the_longest_canonical_decomposition() -> None:
    assert max(len(unicodedata.normalize("NFD", chr(c))) for c in range(0x110000)) \
        == MAX_COMPOSED


def _whitespace_split() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()  # drops the spaces
    return _trained(tokenizer)


def _stripped() -> Tokenizer:
    tokenizer = byte_level()
    tokenizer.normalizer = normalizers.Strip()
    return tokenizer


def _replaced_by_nothing() -> Tokenizer:
    tokenizer = byte_level()
    tokenizer.normalizer = normalizers.Replace(" ", "")
    return tokenizer


def _lstrip_token() -> Tokenizer:
    tokenizer = byte_level()
    tokenizer.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    return tokenizer


def _fused_unknowns() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    return _trained(tokenizer, special_tokens=["<unk>"])


def _word_piece() -> Tokenizer:
    return Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))


def _unigram() -> Tokenizer:
    return Tokenizer(models.Unigram([("<unk>", 0.0), ("a", -1.0)], unk_id=0))


@pytest.mark.parametrize("make", [_whitespace_split, _stripped, _replaced_by_nothing,
                                  _lstrip_token, _fused_unknowns, _word_piece, _unigram])
def test_a_pipeline_that_can_drop_or_fuse_characters_has_no_bound(make: object) -> None:
    assert callable(make)
    assert max_chars_per_token(make()) is None


def test_the_dropping_pipelines_really_drop() -> None:
    """Why they get no bound: far fewer tokens than characters / longest token."""
    assert _whitespace_split().encode(" " * 1000 + "hello").ids != []
    assert len(_whitespace_split().encode(" " * 1000 + "hello").ids) <= 5
    assert len(_fused_unknowns().encode("\u2603" * 1000).ids) == 1
    assert len(_lstrip_token().encode(" " * 1000 + "<mask>").ids) < 1000 / 64
