"""The engine's per-token logprobs in the two OpenAI shapes.

Each engine step is ``{token_id: Logprob}`` with the sampled token first and the top-k
alternatives after it (ranks are 1-based). The completions API wants parallel lists
(``tokens``, ``token_logprobs``, ``top_logprobs`` as ``{text: logprob}`` holding the top-k
plus the sampled token, ``text_offset``); the chat API wants one object per token with
exactly the top-k alternatives. ``-inf`` is sent as -9999.0 (JSON has no infinity).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from engine.core.outputs import Logprob, LogprobsStep
from engine.server.protocol import ChatLogProb, ChatLogProbs, CompletionLogProbs, TopLogProb


def _finite(value: float) -> float:
    return max(value, -9999.0) if not math.isnan(value) else -9999.0


def _text(logprob: Logprob) -> str:
    return logprob.decoded_token or ""


def _top(step: LogprobsStep, num: int) -> list[tuple[int, Logprob]]:
    ranked = [(token, lp) for token, lp in step.items() if lp.rank is not None and lp.rank <= num]
    return sorted(ranked, key=lambda item: item[1].rank or 0)[:num]


def append_completion_logprobs(
    out: CompletionLogProbs, steps: Sequence[LogprobsStep | None], num: int,
    token_texts: Sequence[str] | None = None, text_offset: int = 0,
) -> int:
    """Append ``steps`` to ``out``; returns the text offset after the last token.

    Args:
        out: The logprobs object being filled.
        steps: One step per token; None for a token without logprobs (the first prompt
            token), which then needs its text in ``token_texts``.
        num: Top alternatives per token.
        token_texts: Token texts, needed for None steps.
        text_offset: Offset of the first token in the choice's text.
    """
    for position, step in enumerate(steps):
        if step is None:
            text = token_texts[position] if token_texts else ""
            out.tokens.append(text)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            _, sampled = next(iter(step.items()))
            text = _text(sampled)
            out.tokens.append(text)
            out.token_logprobs.append(_finite(sampled.logprob))
            top = {_text(lp): _finite(lp.logprob) for _, lp in _top(step, num)}
            top.setdefault(text, _finite(sampled.logprob))
            out.top_logprobs.append(top)
        out.text_offset.append(text_offset)
        text_offset += len(text)
    return text_offset


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def chat_logprobs(steps: Sequence[LogprobsStep], num: int) -> ChatLogProbs:
    """The chat API's logprobs for ``steps`` with ``num`` alternatives per token."""
    content = []
    for step in steps:
        _, sampled = next(iter(step.items()))
        text = _text(sampled)
        content.append(ChatLogProb(
            token=text, logprob=_finite(sampled.logprob), bytes=_bytes(_text(sampled)),
            top_logprobs=[TopLogProb(token=_text(lp), logprob=_finite(lp.logprob),
                                     bytes=_bytes(_text(lp))) for _, lp in _top(step, num)]))
    return ChatLogProbs(content=content)
