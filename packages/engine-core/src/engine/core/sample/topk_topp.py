"""Top-k, top-p and min-p masking, vectorised over the batch, without a full sort.

Masked tokens get ``-inf``; rows where a filter is disabled come back unchanged. Each
filter reduces to a per-row *cutoff* logit: tokens strictly below it are masked (tokens
tied with it are kept). The rules are vLLM's:

* top-k: the cutoff is the k-th largest logit.
* top-p (after top-k when both are set): with probabilities renormalised over the
  tokens top-k kept, token ``i`` is kept when the mass of the tokens ranked before it is
  ``< p``; the most likely token is always kept.
* min-p: tokens whose probability is below ``min_p`` times the largest one's, i.e. whose
  logit is below ``max_logit + log(min_p)``.

A full-vocabulary sort costs far more on a CPU than the rest of sampling together, and
the nucleus is usually small, so top-p looks at the ``K`` largest logits only
(``torch.topk``, sorted): when the tokens it keeps end inside those ``K`` candidates the
answer is exact; rows whose nucleus might go on are retried with ``K`` x 8, up to the
whole vocabulary::

    candidates (desc)   v0   v1   v2  ...  vK-1 | rest of the vocabulary (never sorted)
    probs               p0   p1   p2  ...        p_i = exp(v_i - logsumexp(row))
    mass before         0    p0   p0+p1 ...      keep while < p   -> cutoff = last kept v

:func:`top_k_top_p_candidates` returns those candidates themselves, so the sampler can
draw from the few kept tokens of a row instead of from its whole vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "Candidates",
    "apply_top_k_only",
    "apply_top_k_top_p",
    "top_k_top_p_candidates",
    "uses_top_k_top_p",
]

_NEG_INF = float("-inf")
#: Candidates examined first for top-p; grows x8 for rows whose nucleus is larger.
_FIRST_NUM_CANDIDATES = 128


def apply_top_k_only(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keep the ``k[i]`` largest logits of row ``i`` (``k[i] == 0`` keeps everything).

    Args:
        logits: ``[rows, vocab]`` float logits; modified in place.
        k: ``[rows]`` integer top-k values; 0 disables the filter for that row; values
            at or above ``vocab`` keep everything.

    Returns:
        ``logits`` with the masked entries set to ``-inf``.
    """
    vocab = logits.shape[1]
    enabled = (k > 0) & (k < vocab)
    if not bool(enabled.any()):
        return logits
    k_eff = torch.where(enabled, k, 1).long()
    top_values = logits.topk(int(k_eff.max()), dim=1).values
    cutoff = top_values.gather(1, (k_eff - 1).unsqueeze(1))
    cutoff.masked_fill_(~enabled.unsqueeze(1), _NEG_INF)
    return logits.masked_fill_(logits < cutoff, _NEG_INF)


@dataclass(frozen=True)
class Candidates:
    """The largest logits of each row, with the tokens top-k/top-p keep among them.

    Attributes:
        values: ``[rows, K]`` logits in descending order; ``-inf`` where top-k/top-p
            drop the token.
        indices: ``[rows, K]`` their token ids.
        is_final: ``[rows]`` bool: the row uses top-k or top-p and keeps at most 128
            tokens, all among the candidates (False: unfiltered, or it keeps more).
    """

    values: torch.Tensor
    indices: torch.Tensor
    is_final: torch.Tensor


def uses_top_k_top_p(k: torch.Tensor | None, p: torch.Tensor | None,
                     vocab: int) -> torch.Tensor:
    """``[rows]`` bool: the row uses top-k (``0 < k < vocab``) or top-p (``p < 1``).

    Raises:
        ValueError: Both ``k`` and ``p`` are None.
    """
    if k is None and p is None:
        raise ValueError("uses_top_k_top_p needs k or p")
    uses_k = None if k is None else (k > 0) & (k < vocab)
    uses_p = None if p is None else p < 1
    if uses_k is None:
        return uses_p  # type: ignore[return-value]
    return uses_k if uses_p is None else uses_k | uses_p


def _effective(logits: torch.Tensor, k: torch.Tensor | None,
               p: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(k, p, max_k)`` with disabled entries as ``vocab`` and 2.0 (keep everything)."""
    num_rows, vocab = logits.shape
    k_eff = torch.full((num_rows,), vocab, dtype=torch.long, device=logits.device)
    if k is not None:
        k_eff = torch.where((k > 0) & (k < vocab), k.long(), k_eff)
    p_eff = torch.full((num_rows,), 2.0, dtype=torch.float32, device=logits.device)
    if p is not None:
        p_eff = torch.where(p < 1, p.to(torch.float32), p_eff)
    max_k = int(torch.where(k_eff < vocab, k_eff, 0).max()) if k is not None else 0
    return k_eff, p_eff, max_k


def top_k_top_p_candidates(
    logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None
) -> Candidates:
    """One candidate round over every row (``K`` = the largest top-k, at least 128).

    Args:
        logits: ``[rows, vocab]`` float logits; not modified.
        k: ``[rows]`` top-k values (0 disables), or None.
        p: ``[rows]`` top-p values (1.0 disables), or None.

    Returns:
        The candidates; rows with ``is_final`` False must be filtered with
        :func:`apply_top_k_top_p` and sampled from their whole row instead.
    """
    vocab = logits.shape[1]
    k_eff, p_eff, max_k = _effective(logits, k, p)
    num_candidates = min(max(_FIRST_NUM_CANDIDATES, max_k), vocab)
    found = _cutoffs(logits, k_eff, p_eff, num_candidates)
    values = found.values.masked_fill_(found.values < found.cutoff.unsqueeze(1), _NEG_INF)
    # Final only when the row keeps at most _FIRST_NUM_CANDIDATES tokens: a rule on the
    # row alone (K depends on the batch's largest top-k), so a row takes the same path
    # whatever else is in the batch and a seeded request keeps its tokens.
    is_final = (found.is_resolved & ((k_eff < vocab) | (p_eff < 1))
                & (found.num_kept <= _FIRST_NUM_CANDIDATES))
    return Candidates(values, found.indices, is_final)


def apply_top_k_top_p(
    logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None,
    num_candidates: int = _FIRST_NUM_CANDIDATES,
) -> torch.Tensor:
    """Apply top-k and/or top-p; see the module docstring for the exact rule.

    Args:
        logits: ``[rows, vocab]`` float logits; modified in place.
        k: ``[rows]`` top-k values (0 disables), or None when no row uses top-k.
        p: ``[rows]`` top-p values (1.0 disables), or None when no row uses top-p.
        num_candidates: Candidates of the first round (raised to the largest top-k).

    Returns:
        ``logits`` with the masked entries set to ``-inf``.
    """
    if p is None:
        return logits if k is None else apply_top_k_only(logits, k)
    num_rows, vocab = logits.shape
    k_eff, p_eff, max_k = _effective(logits, k, p)
    cutoff = torch.full((num_rows,), _NEG_INF, dtype=logits.dtype, device=logits.device)
    pending = torch.nonzero((p_eff < 1) | (k_eff < vocab)).flatten()
    num_candidates = max(num_candidates, max_k)
    while pending.numel():
        num_candidates = min(num_candidates, vocab)
        rows = logits if pending.numel() == num_rows else logits[pending]
        found = _cutoffs(rows, k_eff[pending], p_eff[pending], num_candidates)
        cutoff[pending[found.is_resolved]] = found.cutoff[found.is_resolved]
        pending = pending[~found.is_resolved]
        num_candidates *= 8
    return logits.masked_fill_(logits < cutoff.unsqueeze(1), _NEG_INF)


@dataclass(frozen=True)
class _Round:
    """One candidate round: per-row cutoff logit and kept count, and the candidates."""

    cutoff: torch.Tensor
    num_kept: torch.Tensor
    is_resolved: torch.Tensor
    values: torch.Tensor
    indices: torch.Tensor


def _cutoffs(rows: torch.Tensor, k: torch.Tensor, p: torch.Tensor, num_candidates: int) -> _Round:
    """Top-k/top-p cutoff of each row from its ``num_candidates`` largest logits.

    ``is_resolved`` is False where the kept tokens fill every candidate and the nucleus
    may continue beyond them.
    """
    vocab = rows.shape[1]
    values, indices = rows.topk(num_candidates, dim=1)  # sorted, descending
    positions = torch.arange(num_candidates, device=rows.device)
    in_k = positions.unsqueeze(0) < k.unsqueeze(1)
    if bool((p < 1).any()):
        # Top-p renormalises over the top-k tokens (all among the candidates), else
        # over the whole row.
        top = values[:, :1]
        row_norm = top.squeeze(1) + (rows - top).exp_().sum(dim=1).log_()
        k_norm = torch.logsumexp(values.masked_fill(~in_k, _NEG_INF), dim=1)
        norm = torch.where(k < vocab, k_norm, row_norm)
        probs = (values - norm.unsqueeze(1)).exp_().masked_fill_(~in_k, 0.0)
        mass_before = probs.cumsum(dim=1) - probs
        in_k &= mass_before < p.unsqueeze(1)
    num_kept = in_k.sum(dim=1).clamp_(min=1)
    cutoff = values.gather(1, (num_kept - 1).unsqueeze(1)).squeeze(1)
    resolved = (num_kept < num_candidates) | (k <= num_candidates) | (num_candidates == vocab)
    return _Round(cutoff, num_kept, resolved, values, indices)
