"""Apply a step's grammar bitmask to the logits (in the worker, before sampling)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.sdk.structured_output import GrammarBitmask

_SHIFTS = torch.arange(32, dtype=torch.int32)


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The bool ``[rows, vocab_size]`` view of an int32 bitmask.

    Bit ``j`` of word ``i`` is token ``32 * i + j``.
    """
    bits = (bitmask.to(torch.int32).unsqueeze(-1) >> _SHIFTS.to(bitmask.device)) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_grammar_bitmask(logits: torch.Tensor, grammar: GrammarBitmask,
                          req_ids: Sequence[str]) -> None:
    """Set the logits of disallowed tokens to ``-inf`` in the rows of ``grammar.req_ids``.

    ``logits`` has one row per request of ``req_ids``. A row whose mask allows nothing is
    left unmasked: the grammar then refuses the sampled token and the engine fails that
    request, instead of sampling from an all ``-inf`` row.
    """
    index = {req_id: row for row, req_id in enumerate(req_ids)}
    pairs = [(index[req_id], i) for i, req_id in enumerate(grammar.req_ids) if req_id in index]
    if not pairs:
        return
    rows = torch.tensor([row for row, _ in pairs], device=logits.device)
    allowed = allowed_tokens(grammar.bitmask[[i for _, i in pairs]].to(logits.device),
                             logits.shape[1])
    allowed |= ~allowed.any(dim=1, keepdim=True)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
