"""How many characters of input one token can stand for: a token count without tokenizing.

A 20 MB prompt takes tens of seconds to tokenize, only to be refused for not fitting the
context. A text of ``N`` characters has at least ``ceil(N / K)`` tokens, where ``K`` is the
most characters of input any one token can stand for; when that already exceeds the
context, the prompt is refused without tokenizing it.

``K`` is derived from the tokenizer's own description (``tokenizer.json``), following the
``tokenizers`` pipeline a text goes through, and only where each step is known to keep the
argument true (otherwise there is no bound, and the prompt is tokenized as before):

1. **Added tokens** (``<|im_start|>``, ...) are cut out of the raw text first. Each stands
   for exactly its content: ``len(content)`` characters (of the normalized text when it is
   ``normalized``). A token with ``lstrip``/``rstrip`` also swallows the whitespace beside
   it, any amount of it: no bound.
2. **The normalizer** may lengthen the text (lowercasing, NFD/NFKD, ``Prepend``, a
   ``Replace`` by something at least as long) or shorten it by a known factor ``S``: NFC
   and NFKC compose one character out of at most :data:`MAX_COMPOSED` (the longest
   canonical decomposition of a character: 4, e.g. U+1F82; compositions are frozen by
   Unicode's stability policy), and a ``Replace`` of a literal ``p`` by a shorter ``c``
   shrinks by ``ceil(len(p) / len(c))``. So every normalized character stands for at most
   ``S`` characters of input (the product over a ``Sequence``). A normalizer that may delete
   characters (``Strip``, ``StripAccents``, ``Nmt``, ``Precompiled`` (sentencepiece's
   character map), ``BertNormalizer`` cleaning text or stripping accents, a ``Replace`` by
   nothing or of a regex), or one not listed here: no bound.
3. **The pre-tokenizer** splits the normalized text without dropping characters
   (``ByteLevel``, ``Metaspace``, ``Split``/``Punctuation`` unless their behaviour is
   ``removed``, ``Digits``, ``UnicodeScripts``). One that drops them (``Whitespace``,
   ``WhitespaceSplit``, ``BertPreTokenizer``, ``CharDelimiterSplit``) or is not listed: no
   bound.
4. **The model** turns each piece into vocabulary tokens, each standing for a run of the
   piece. A token's vocabulary string is never shorter than what it stands for: it is that
   run itself (plus ``##``/``</w>`` markers), or in a **byte-level** vocabulary one
   character per UTF-8 byte of the run (``Ġ`` is the byte of a space), and a character is
   at least one byte; a byte-fallback token (``<0xE4>``) stands for one byte. A BPE model
   that fuses unknown characters into one unknown token (``fuse_unk``, unless byte
   fallback covers every byte), a Unigram model without byte fallback (it fuses unknown
   characters too), WordPiece and WordLevel (a whole word can become one ``[UNK]``): no
   bound.
5. **The post-processor** only adds tokens (BOS, ...); the engine never truncates.

So with ``L``, the longest vocabulary string or added-token content, one token stands for
at most ``K = S * L`` characters of input.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

#: The longest canonical decomposition of one character (NFC/NFKC compose at most this many
#: characters into one). Checked against ``unicodedata`` by the tests.
MAX_COMPOSED = 4

#: Normalizers that never make a text shorter.
_LENGTHENING_NORMALIZERS = frozenset({"NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"})
#: Pre-tokenizers that keep every character (those with a ``behavior`` unless "Removed").
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "UnicodeScripts",
                                     "Split", "Punctuation"})


def max_chars_per_token(backend: BackendTokenizer) -> int | None:
    """The most characters of input one token of ``backend`` can stand for (module docstring).

    Returns:
        ``K``: every text of ``N`` characters encodes to at least ``ceil(N / K)`` tokens;
        ``None`` when the tokenizer's pipeline gives no such bound.
    """
    spec = json.loads(backend.to_str())
    added = spec.get("added_tokens") or []
    if any(token.get("lstrip") or token.get("rstrip") for token in added):
        return None
    shrink = _normalizer_shrink(spec.get("normalizer"))
    vocab = backend.get_vocab(with_added_tokens=True)
    if (shrink is None or not _keeps_characters(spec.get("pre_tokenizer"))
            or not _model_keeps_runs(spec.get("model") or {}, vocab)):
        return None
    longest = max([len(token) for token in vocab]
                  + [len(str(token.get("content", ""))) for token in added] + [1])
    return shrink * longest


def _normalizer_shrink(spec: Mapping[str, Any] | None) -> int | None:
    """Input characters per normalized character at most; None: it may delete characters."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind in _LENGTHENING_NORMALIZERS:
        return 1
    if kind in ("NFC", "NFKC"):
        return MAX_COMPOSED
    if kind == "Sequence":
        factor = 1
        for part in spec.get("normalizers") or []:
            shrink = _normalizer_shrink(part)
            if shrink is None:
                return None
            factor *= shrink
        return factor
    if kind == "Replace":
        pattern, content = spec.get("pattern") or {}, str(spec.get("content", ""))
        literal = pattern.get("String") if isinstance(pattern, Mapping) else None
        if not isinstance(literal, str) or not literal or not content:
            return None
        return max(1, math.ceil(len(literal) / len(content)))
    if kind == "BertNormalizer":
        strips = spec.get("strip_accents")
        if spec.get("clean_text") or strips or (strips is None and spec.get("lowercase")):
            return None
        return 1
    return None


def _keeps_characters(spec: Mapping[str, Any] | None) -> bool:
    """Whether the pre-tokenizer splits without dropping any character."""
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_keeps_characters(part) for part in spec.get("pretokenizers") or [])
    return kind in _KEEPING_PRE_TOKENIZERS and str(spec.get("behavior", "")).lower() != "removed"


def _model_keeps_runs(spec: Mapping[str, Any], vocab: Mapping[str, int]) -> bool:
    """Whether each token stands for no more than its vocabulary string's length."""
    kind = spec.get("type")
    has_all_bytes = all(f"<0x{byte:02X}>" in vocab for byte in range(256))
    if kind == "BPE":
        fuses = spec.get("unk_token") is not None and bool(spec.get("fuse_unk"))
        return not fuses or (bool(spec.get("byte_fallback")) and has_all_bytes)
    if kind == "Unigram":
        return bool(spec.get("byte_fallback")) and has_all_bytes
    return False
