"""Repetition, frequency and presence penalties, vectorised and sparse.

A penalty only changes the logits of tokens a request has seen, so the work is done on
those entries alone (indexed reads and writes into the flattened logits at
``row * vocab_size + token_id``), never on whole ``[rows, vocab]`` rows::

    repetition  (prompt or output token)  logit > 0: logit / r    else: logit * r
    frequency   (output tokens)           logit -= f * count      (accumulated per occurrence)
    presence    (output tokens)           logit -= p              (once per distinct token)

Repetition is applied first, on the logits as they come in (vLLM's order). Token ids
arrive right-padded with ``vocab_size``. A token id repeated in a row is read by every
indexed read before any write, so its copies all write the same value; padding
is therefore replaced by a duplicate of the row's first token (rows without any token
get index 0 and a neutral penalty).
"""

from __future__ import annotations

import torch

from engine.core.sample.metadata import PenaltyMetadata

__all__ = ["apply_penalties"]


def _without_padding(token_ids: torch.Tensor, vocab_size: int) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids, is_real, has_any)``: padding replaced by each row's first real token."""
    is_real = token_ids < vocab_size
    has_any = is_real.any(dim=1)
    first = token_ids.gather(1, is_real.to(torch.uint8).argmax(dim=1, keepdim=True))
    first = torch.where(has_any.unsqueeze(1), first, 0)
    return torch.where(is_real, token_ids, first), is_real, has_any


def apply_penalties(logits: torch.Tensor, penalties: PenaltyMetadata) -> torch.Tensor:
    """Apply ``penalties`` to the rows of ``logits`` they name; other rows are untouched.

    Args:
        logits: ``[num_reqs, vocab_size]`` float logits; modified in place (made
            contiguous first if needed).
        penalties: The batch's penalty inputs: the rows, their penalties and the padded
            prompt (None: no repetition penalty in the batch) and output token ids.

    Returns:
        The penalised logits.
    """
    logits = logits.contiguous()
    num_rows, vocab_size = logits.shape
    flat, dtype = logits.view(-1), logits.dtype
    rows = penalties.rows
    if rows is None:
        rows = torch.arange(num_rows, device=logits.device)
    row_base = rows.unsqueeze(1) * vocab_size
    if penalties.prompt_token_ids is not None:
        seen = torch.cat((penalties.prompt_token_ids, penalties.output_token_ids), dim=1)
        seen_ids, _, has_seen = _without_padding(seen, vocab_size)
        factor = torch.where(has_seen, penalties.repetition.to(dtype), 1.0).unsqueeze(1)
        index = row_base + seen_ids
        values = flat[index]
        flat[index] = torch.where(values > 0, values / factor, values * factor)
    output_ids, is_output, has_output = _without_padding(penalties.output_token_ids,
                                                         vocab_size)
    index = row_base + output_ids
    per_occurrence = -penalties.frequency.to(dtype).unsqueeze(1) * is_output
    flat.index_put_((index,), per_occurrence, accumulate=True)
    once = torch.where(has_output, penalties.presence.to(dtype), 0.0).unsqueeze(1)
    flat[index] = flat[index] - once
    return logits
