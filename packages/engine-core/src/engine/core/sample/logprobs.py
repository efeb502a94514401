"""Log-probabilities of sampled (or prompt) tokens and the top-k alternatives.

Logprobs are those of the model's *raw* distribution (``log_softmax`` of the logits as
the model produced them, before processors, penalties, temperature and filters), as vLLM
reports them by default. Layout: column 0 is the token of interest (the sampled token, or
the next prompt token for prompt logprobs), columns ``1..k`` the top-k tokens in
descending order; ``ranks`` is the 1-based rank of the token of interest (1 + the number
of tokens with a strictly larger logprob).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.sdk.scheduler import SampleLogprobs

__all__ = ["LogprobsTensors", "compute_logprobs", "gather_logprobs", "to_sample_logprobs"]


@dataclass(frozen=True)
class LogprobsTensors:
    """Logprobs of ``n`` rows, ``k`` top tokens each.

    Attributes:
        token_ids: ``[n, k + 1]`` int64; column 0 the token of interest, then the top-k.
        logprobs: ``[n, k + 1]`` float32 log-probabilities of those tokens.
        ranks: ``[n]`` int64 1-based rank of the token of interest.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor

    def select(self, rows: torch.Tensor | Sequence[int]) -> LogprobsTensors:
        """The subset of rows ``rows`` (e.g. the requests that completed their prompt)."""
        index = torch.as_tensor(rows, dtype=torch.long, device=self.token_ids.device)
        return LogprobsTensors(self.token_ids[index], self.logprobs[index], self.ranks[index])


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """``log_softmax`` over the vocabulary in float32 (a new tensor)."""
    return torch.log_softmax(logits, dim=-1, dtype=torch.float32)


def gather_logprobs(
    logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor
) -> LogprobsTensors:
    """Gather the logprob and rank of ``token_ids`` and the top ``num_logprobs`` tokens.

    Reusable for prompt logprobs: pass each prompt position's logprobs and the next
    prompt token as ``token_ids``.

    Args:
        logprobs: ``[n, vocab]`` float32 log-probabilities.
        num_logprobs: ``k >= 0`` top tokens to include.
        token_ids: ``[n]`` int64 tokens of interest.

    Returns:
        ``LogprobsTensors`` with ``k + 1`` columns.

    Raises:
        ValueError: ``num_logprobs`` is negative.
    """
    if num_logprobs < 0:
        raise ValueError(f"num_logprobs must be >= 0, got {num_logprobs}")
    token_ids = token_ids.long().unsqueeze(1)
    token_logprobs = logprobs.gather(1, token_ids)
    ranks = (logprobs > token_logprobs).sum(dim=1) + 1
    if num_logprobs == 0:
        return LogprobsTensors(token_ids, token_logprobs, ranks)
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=1)
    return LogprobsTensors(
        torch.cat((token_ids, top_ids), dim=1),
        torch.cat((token_logprobs, top_logprobs), dim=1),
        ranks,
    )


def to_sample_logprobs(tensors: LogprobsTensors, rows_k: Sequence[int]) -> SampleLogprobs:
    """Convert to the SDK's plain-Python :class:`SampleLogprobs`.

    Args:
        tensors: ``n`` rows with ``k + 1`` columns.
        rows_k: ``n`` per-row top-k counts, each ``<= k``; row ``i`` keeps its first
            ``1 + rows_k[i]`` columns.

    Returns:
        The rows as tuples (one host copy for the whole batch).

    Raises:
        ValueError: ``rows_k`` has the wrong length or asks for more columns than exist.
    """
    num_rows, num_cols = tensors.token_ids.shape
    if len(rows_k) != num_rows:
        raise ValueError(f"rows_k has {len(rows_k)} entries for {num_rows} rows")
    if rows_k and max(rows_k) >= num_cols:
        raise ValueError(f"rows_k asks for {max(rows_k)} top tokens; only {num_cols - 1} "
                         "were gathered")
    token_ids = tensors.token_ids.tolist()
    logprobs = tensors.logprobs.tolist()
    return SampleLogprobs(
        token_ids=tuple(tuple(ids[: 1 + k]) for ids, k in zip(token_ids, rows_k, strict=True)),
        logprobs=tuple(tuple(lps[: 1 + k]) for lps, k in zip(logprobs, rows_k, strict=True)),
        sampled_token_ranks=tuple(tensors.ranks.tolist()),
    )
