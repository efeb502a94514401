"""``BatchSamplingParams``: per-slot sampling parameters of the persistent batch.

The input batch owns one. Each parameter lives in a preallocated CPU tensor of
``max_num_reqs`` entries (written through a numpy view, so a request's arrival costs a
few scalar stores); sets of request ids record which requests use which feature, so
:meth:`BatchSamplingParams.make_metadata` leaves out every feature no request uses.
Disabled values are neutral: temperature 1, top-k 0, top-p 1, min-p 0, penalties 0/0/1;
greedy rows hold neutral temperature and filters (their token is the argmax, picked by
``is_greedy``) so the random path does no work for them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.core.logits_processors import MinPLogitsProcessor
from engine.core.sample.metadata import PenaltyMetadata, SamplingMetadata
from engine.sdk.logits_processor import LogitsProcessor
from engine.sdk.sampling_params import SamplingParams

__all__ = ["BatchSamplingParams", "TokenBuffers"]


@dataclass(frozen=True)
class TokenBuffers:
    """Read-only view of the input batch's token buffers that penalties need.

    Attributes:
        token_ids: ``[max_num_reqs, max_model_len]`` int32 prompt + output ids per slot.
        num_prompt_tokens: ``[max_num_reqs]`` prompt length per slot.
        num_tokens: ``[max_num_reqs]`` prompt + output length per slot.
    """

    token_ids: np.ndarray
    num_prompt_tokens: np.ndarray
    num_tokens: np.ndarray


def _padded(token_ids: np.ndarray, rows: np.ndarray, start: np.ndarray, stop: np.ndarray,
            pad: int) -> torch.Tensor:
    """``token_ids[row, start:stop]`` of each row, right-padded with ``pad``, as int64."""
    lengths = stop - start
    width = max(int(lengths.max()), 1)
    offsets = np.arange(width)
    valid = offsets[None, :] < lengths[:, None]
    positions = np.where(valid, start[:, None] + offsets[None, :], 0)
    values = np.where(valid, token_ids[rows[:, None], positions], pad)
    return torch.from_numpy(values.astype(np.int64))


class BatchSamplingParams:
    """Sampling parameters per slot, and the feature sets used to skip unused work.

    Args:
        max_num_reqs: Slots in the batch.
        vocab_size: Columns of the logits.
        device: Where the metadata tensors go.
        logits_processors: The worker's processors, split by call site for the metadata.
    """

    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device | str,
                 logits_processors: Sequence[LogitsProcessor]) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.non_argmax_invariant = tuple(
            p for p in logits_processors if not p.is_argmax_invariant())
        self.argmax_invariant = tuple(p for p in logits_processors if p.is_argmax_invariant())
        #: min-p is applied by the sampler only when no min-p processor owns it.
        self.has_min_p_processor = any(
            isinstance(p, MinPLogitsProcessor) for p in logits_processors)

        def buffer(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(max_num_reqs, dtype=dtype)

        self.temperature, self.top_p, self.min_p = (buffer(torch.float32) for _ in range(3))
        self.top_k = buffer(torch.int64)
        self.presence, self.frequency, self.repetition = (
            buffer(torch.float32) for _ in range(3))
        self.is_greedy = buffer(torch.bool)
        self._tensors = (self.temperature, self.top_p, self.min_p, self.top_k, self.presence,
                         self.frequency, self.repetition, self.is_greedy)
        self._arrays = tuple(t.numpy() for t in self._tensors)

        self.greedy_req_ids: set[str] = set()
        self.random_req_ids: set[str] = set()
        self.top_k_req_ids: set[str] = set()
        self.top_p_req_ids: set[str] = set()
        self.min_p_req_ids: set[str] = set()
        self.penalty_req_ids: set[str] = set()
        self.repetition_req_ids: set[str] = set()
        #: ``req_id -> logprobs`` of the requests that asked for sample logprobs.
        self.num_logprobs: dict[str, int] = {}
        #: ``req_id -> prompt_logprobs`` of the requests that asked for prompt logprobs.
        self.num_prompt_logprobs: dict[str, int] = {}
        #: ``req_id -> generator`` of the seeded random requests.
        self.generators: dict[str, torch.Generator] = {}

    def add(self, req_id: str, slot: int, params: SamplingParams,
            generator: torch.Generator | None) -> None:
        """Record a request's parameters in ``slot``."""
        greedy = params.is_greedy
        # Greedy rows get neutral temperature and filters: their token is the argmax.
        values = (1.0, 1.0, 0.0, 0, params.presence_penalty, params.frequency_penalty,
                  params.repetition_penalty, True) if greedy else (
                  params.temperature, params.top_p, params.min_p, params.top_k,
                  params.presence_penalty, params.frequency_penalty,
                  params.repetition_penalty, False)
        for array, value in zip(self._arrays, values, strict=True):
            array[slot] = value
        (self.greedy_req_ids if greedy else self.random_req_ids).add(req_id)
        if not greedy:
            self._add_random_features(req_id, params, generator)
        if params.presence_penalty or params.frequency_penalty or (
                params.repetition_penalty != 1.0):
            self.penalty_req_ids.add(req_id)
            if params.repetition_penalty != 1.0:
                self.repetition_req_ids.add(req_id)
        if params.logprobs is not None:
            self.num_logprobs[req_id] = params.logprobs
        if params.prompt_logprobs is not None:
            self.num_prompt_logprobs[req_id] = params.prompt_logprobs

    def _add_random_features(self, req_id: str, params: SamplingParams,
                             generator: torch.Generator | None) -> None:
        if 0 < params.top_k < self.vocab_size:
            self.top_k_req_ids.add(req_id)
        if params.top_p < 1.0:
            self.top_p_req_ids.add(req_id)
        if params.min_p > 0.0:
            self.min_p_req_ids.add(req_id)
        if generator is not None:
            self.generators[req_id] = generator

    def remove(self, req_id: str) -> None:
        """Forget a request (its slot's values are overwritten by the next arrival)."""
        for ids in (self.greedy_req_ids, self.random_req_ids, self.top_k_req_ids,
                    self.top_p_req_ids, self.min_p_req_ids, self.penalty_req_ids,
                    self.repetition_req_ids):
            ids.discard(req_id)
        for mapping in (self.num_logprobs, self.num_prompt_logprobs, self.generators):
            mapping.pop(req_id, None)

    def move(self, src: int, dst: int) -> None:
        """Copy slot ``src``'s values into slot ``dst``."""
        for array in self._arrays:
            array[dst] = array[src]

    def make_metadata(
        self, req_id_to_index: Mapping[str, int], is_partial: np.ndarray, tokens: TokenBuffers,
    ) -> SamplingMetadata:
        """Build the step's :class:`SamplingMetadata` for slots ``0 .. num_reqs - 1``.

        Args:
            req_id_to_index: Slot of every request in the (dense) batch.
            is_partial: ``[num_reqs]`` bool, True on rows of partial prefills.
            tokens: The batch's token buffers (for penalties).

        Returns:
            The metadata; unused features are None.
        """
        num_reqs = len(is_partial)
        all_greedy = not self.random_req_ids
        all_random = not self.greedy_req_ids
        temperature = None
        if not all_greedy and bool(np.any(self._arrays[0][:num_reqs] != 1.0)):
            temperature = self._on_device(self.temperature, num_reqs)
        min_p = None
        if self.min_p_req_ids and not self.has_min_p_processor:
            min_p = self._on_device(self.min_p, num_reqs)
        return SamplingMetadata(
            all_greedy=all_greedy,
            all_random=all_random,
            temperature=temperature,
            is_greedy=None if all_greedy or all_random else self._on_device(
                self.is_greedy, num_reqs),
            top_k=self._on_device(self.top_k, num_reqs) if self.top_k_req_ids else None,
            top_p=self._on_device(self.top_p, num_reqs) if self.top_p_req_ids else None,
            min_p=min_p,
            penalties=self._penalties(req_id_to_index, num_reqs, tokens),
            generators={req_id_to_index[r]: g for r, g in self.generators.items()},
            max_num_logprobs=max(self.num_logprobs.values()) if self.num_logprobs else None,
            is_partial=is_partial,
            non_argmax_invariant_processors=self.non_argmax_invariant,
            argmax_invariant_processors=self.argmax_invariant,
        )

    def _on_device(self, tensor: torch.Tensor, num_reqs: int) -> torch.Tensor:
        return tensor[:num_reqs].to(self.device, non_blocking=True)

    def _penalties(self, req_id_to_index: Mapping[str, int], num_reqs: int,
                   tokens: TokenBuffers) -> PenaltyMetadata | None:
        if not self.penalty_req_ids:
            return None
        if len(self.penalty_req_ids) == num_reqs:
            rows = np.arange(num_reqs)
        else:
            rows = np.sort(np.fromiter(
                (req_id_to_index[r] for r in self.penalty_req_ids), dtype=np.int64))
        num_prompt = tokens.num_prompt_tokens[rows]
        prompt_ids = None
        if self.repetition_req_ids:
            prompt_ids = _padded(tokens.token_ids, rows, np.zeros_like(num_prompt),
                                 num_prompt, self.vocab_size).to(self.device)
        output_ids = _padded(tokens.token_ids, rows, num_prompt, tokens.num_tokens[rows],
                             self.vocab_size).to(self.device)
        index = torch.from_numpy(rows)
        return PenaltyMetadata(
            rows=None if len(rows) == num_reqs else index.to(self.device),
            presence=self.presence[index].to(self.device),
            frequency=self.frequency[index].to(self.device),
            repetition=self.repetition[index].to(self.device),
            prompt_token_ids=prompt_ids,
            output_token_ids=output_ids,
        )
