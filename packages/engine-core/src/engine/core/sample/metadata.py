"""``SamplingMetadata``: everything the sampler needs for one step, built by the input batch.

Every optional field is None when no request in the batch needs the feature, so the
sampler skips that work entirely (an all-greedy batch without penalties or
non-argmax-invariant processors costs one ``argmax``). Row ``i`` of every per-row tensor
belongs to slot ``i`` of the persistent batch, like row ``i`` of the logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.sdk.logits_processor import LogitsProcessor

__all__ = ["PenaltyMetadata", "SamplingMetadata"]


@dataclass(frozen=True)
class PenaltyMetadata:
    """Repetition, frequency and presence penalties of the rows that use any of them.

    Attributes:
        rows: Logits rows the penalties apply to (int64, ascending), or None for every
            row of the batch. The tensors below have one row per penalised row.
        presence: ``[num_penalised]`` presence penalties (0 disables).
        frequency: ``[num_penalised]`` frequency penalties (0 disables).
        repetition: ``[num_penalised]`` repetition penalties (1 disables).
        prompt_token_ids: ``[num_penalised, max_prompt_len]`` int64 prompt ids, padded
            with ``vocab_size``; None when no row has a repetition penalty (only the
            repetition penalty looks at the prompt).
        output_token_ids: ``[num_penalised, max_output_len]`` int64 generated ids, padded
            with ``vocab_size``.
    """

    rows: torch.Tensor | None
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor
    prompt_token_ids: torch.Tensor | None
    output_token_ids: torch.Tensor


@dataclass(frozen=True)
class SamplingMetadata:
    """Per-step sampling inputs of the whole batch.

    Attributes:
        all_greedy: Every request takes the argmax (no random path this step).
        all_random: No request is greedy.
        temperature: ``[num_reqs]`` float32 temperatures, 1.0 on greedy rows; None when
            the batch is all greedy or every random row has temperature 1.
        is_greedy: ``[num_reqs]`` bool, True on greedy rows; None when the batch is all
            greedy or all random.
        top_k: ``[num_reqs]`` int64, 0 where top-k is disabled; None when no row uses it.
        top_p: ``[num_reqs]`` float32, 1.0 where disabled; None when no row uses it.
        min_p: ``[num_reqs]`` float32, 0.0 where disabled; None when no row uses it or when
            a min-p logits processor is loaded (it owns min-p then).
        penalties: Penalty inputs, or None when no row uses a penalty.
        generators: ``{row: generator}`` of the requests that have a seed.
        max_num_logprobs: Largest ``logprobs`` any request asked for, or None when none did.
        is_partial: ``[num_reqs]`` bool numpy array, True on rows of requests in the middle
            of a chunked prefill: their token is discarded and their generator must not
            advance.
        non_argmax_invariant_processors: Applied to the raw logits of every row.
        argmax_invariant_processors: Applied on the random path after temperature.
    """

    all_greedy: bool
    all_random: bool
    temperature: torch.Tensor | None
    is_greedy: torch.Tensor | None
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    penalties: PenaltyMetadata | None
    generators: dict[int, torch.Generator]
    max_num_logprobs: int | None
    is_partial: np.ndarray
    non_argmax_invariant_processors: tuple[LogitsProcessor, ...] = ()
    argmax_invariant_processors: tuple[LogitsProcessor, ...] = ()

    @property
    def num_reqs(self) -> int:
        """Number of rows (requests) in the batch."""
        return len(self.is_partial)
