"""The sampler: one token per request from the logits of the batch.

Order of operations (vLLM V1's), each skipped when no request needs it::

    1. raw logprobs      log_softmax of the logits as the model produced them
    2. non-argmax-invariant logits processors   (min_tokens, logit_bias, plugins)
    3. penalties         repetition, frequency, presence
    4. greedy            argmax, for greedy rows       -> done if the batch is all greedy
    5. temperature       logits / T
    6. argmax-invariant logits processors       (min_p, plugins; or the sampler's own
                         min-p when no min-p processor is loaded)
    7. top-k / top-p     on the largest logits only (see ``topk_topp``)
    8. random            inverse CDF: one uniform u per row, the first token whose
                         cumulative probability exceeds u
    9. gather logprobs   of the sampled token (rank, column 0) and the top-k

Random sampling draws one uniform number per row: ``searchsorted(cumsum(p), u * sum(p))``
picks token ``i`` with probability ``p_i``. (The exponential race, ``argmax(p / E)`` with
``E ~ Exp(1)`` per token, draws ``vocab_size`` random numbers per row; on a CPU that is
~70 ms for 64 x 50k logits on one core, more than the rest of sampling together.) A
seeded request draws its uniform from its own ``torch.Generator``, exactly one draw per
sampled token, so its tokens do not depend on the rest of the batch, and a resumed
request's generator is brought back in step by repeating that many draws. Rows in the
middle of a chunked prefill do not draw from their generator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.core.logits_processors import apply_min_p
from engine.core.sample.logprobs import LogprobsTensors, compute_logprobs, gather_logprobs
from engine.core.sample.metadata import SamplingMetadata
from engine.core.sample.penalties import apply_penalties
from engine.core.sample.topk_topp import (
    apply_top_k_top_p,
    top_k_top_p_candidates,
    uses_top_k_top_p,
)

if TYPE_CHECKING:
    from engine.core.sample.faults import LogitsFaults
    from engine.sdk.logits_processor import LogitsProcessor

__all__ = ["Sampler", "SamplerOutput", "draw_uniform", "make_request_generator"]

#: Rows whose nucleus outgrew the first candidate round start the next one this large.
_SECOND_NUM_CANDIDATES = 1024


@dataclass(frozen=True)
class SamplerOutput:
    """What the sampler returns for one step.

    Attributes:
        sampled_token_ids: ``[num_reqs]`` int64, one token per row (rows of partial
            prefills hold a token to discard).
        logprobs: Raw logprobs of the sampled tokens and the top ``max_num_logprobs``
            tokens of every row, or None when no request asked for logprobs.
    """

    sampled_token_ids: torch.Tensor
    logprobs: LogprobsTensors | None


def draw_uniform(generator: torch.Generator | None, device: torch.device | str) -> torch.Tensor:
    """One draw: a ``[1]`` float64 uniform in [0, 1) from ``generator`` (the global one if None).

    A seeded request makes exactly one draw per sampled token.
    """
    return torch.rand(1, dtype=torch.float64, generator=generator, device=device)


def make_request_generator(
    seed: int, device: torch.device | str, num_draws: int = 0
) -> torch.Generator:
    """A request's generator, seeded and advanced past ``num_draws`` earlier draws.

    A request resumed after preemption already sampled ``num_draws`` tokens; advancing
    its fresh generator by as many draws makes its next tokens the ones it would have
    sampled had it never been preempted.

    Args:
        seed: ``SamplingParams.seed``.
        device: The device the logits live on.
        num_draws: Tokens already sampled for the request.

    Returns:
        The generator.
    """
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    for _ in range(num_draws):
        draw_uniform(generator, device)
    return generator


class Sampler:
    """Samples one token per row; see the module docstring for the order of operations.

    Stateless: all per-request state is in the :class:`SamplingMetadata` (and in the
    logits processors it lists). May modify ``logits`` in place.

    Args:
        faults: Records a logits processor's failure (and the rows it failed) instead of
            raising it (rank 0's worker); None lets exceptions propagate.
    """

    def __init__(self, faults: LogitsFaults | None = None) -> None:
        self.faults = faults

    def _apply(self, processor: LogitsProcessor, logits: torch.Tensor) -> torch.Tensor:
        if self.faults is None:
            return processor.apply(logits)
        return self.faults.apply(processor, logits)

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample the batch.

        Args:
            logits: ``[num_reqs, vocab_size]`` float32 logits of each request's last
                scheduled token, row ``i`` = slot ``i``. Modified in place.
            metadata: The step's sampling inputs, from ``InputBatch.make_sampling_metadata``.

        Returns:
            The sampled token ids and, when requested, their logprobs.
        """
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = compute_logprobs(logits)
        for processor in metadata.non_argmax_invariant_processors:
            logits = self._apply(processor, logits)
        if metadata.penalties is not None:
            logits = apply_penalties(logits, metadata.penalties)
        sampled = self.sample(logits, metadata)
        logprobs = None
        if raw_logprobs is not None and metadata.max_num_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, metadata.max_num_logprobs, sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Steps 4-8: greedy and/or random sampling of processed logits.

        Args:
            logits: ``[num_reqs, vocab_size]`` logits after processors and penalties;
                modified in place.
            metadata: The step's sampling inputs.

        Returns:
            ``[num_reqs]`` int64 token ids.
        """
        # max's indices are argmax's (the first of equal maxima; a NaN wins), at a third of
        # its time on the CPU: torch's argmax reduction is not vectorised there.
        greedy = None if metadata.all_random else logits.max(dim=1).indices
        if greedy is not None and metadata.all_greedy:
            return greedy
        if metadata.temperature is not None:
            logits.div_(metadata.temperature.unsqueeze(1))
        for processor in metadata.argmax_invariant_processors:
            logits = self._apply(processor, logits)
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        return self.random_sample(logits, metadata, greedy)

    def random_sample(self, logits: torch.Tensor, metadata: SamplingMetadata,
                      greedy: torch.Tensor | None = None) -> torch.Tensor:
        """Steps 7-8: top-k/top-p, then one inverse-CDF draw per random row.

        A row that uses top-k or top-p and whose kept tokens are all among the first
        round's candidates draws from those candidates; every other random row draws
        from its whole (filtered) row. Which path a row takes depends on that row alone.

        Args:
            logits: ``[num_reqs, vocab_size]`` processed, temperature-scaled logits
                (``-inf`` = never drawn); may be overwritten.
            metadata: Filters, the seeded rows' generators, the greedy and partial masks.
            greedy: The greedy tokens, taken for greedy rows (None: the batch is all random).

        Returns:
            ``[num_reqs]`` int64 token ids.
        """
        num_rows = logits.shape[0]
        uniforms = self._uniforms(num_rows, metadata, logits.device)
        if greedy is None or metadata.is_greedy is None:
            tokens = torch.empty(num_rows, dtype=torch.long, device=logits.device)
            remaining = torch.ones(num_rows, dtype=torch.bool, device=logits.device)
        else:
            tokens, remaining = greedy.clone(), ~metadata.is_greedy
        k, p = metadata.top_k, metadata.top_p
        if k is not None or p is not None:
            rows = torch.nonzero(remaining & uses_top_k_top_p(k, p, logits.shape[1])).flatten()
            if rows.numel():
                final_rows = self._sample_candidates(logits, rows, uniforms, tokens, k, p)
                remaining[final_rows] = False
        rows = torch.nonzero(remaining).flatten()
        if rows.numel() == num_rows:
            logits = apply_top_k_top_p(logits, k, p, num_candidates=_SECOND_NUM_CANDIDATES)
            tokens = _inverse_cdf(logits, uniforms).squeeze(1)
        elif rows.numel():
            sub = apply_top_k_top_p(logits[rows], _take(k, rows), _take(p, rows),
                                    num_candidates=_SECOND_NUM_CANDIDATES)
            tokens[rows] = _inverse_cdf(sub, uniforms[rows]).squeeze(1)
        return tokens

    @staticmethod
    def _sample_candidates(logits: torch.Tensor, rows: torch.Tensor, uniforms: torch.Tensor,
                           tokens: torch.Tensor, k: torch.Tensor | None,
                           p: torch.Tensor | None) -> torch.Tensor:
        """Sample ``rows`` (which use top-k/top-p) from their candidates where final.

        Writes ``tokens`` of those rows and returns them (the others are left to the
        whole-row path).
        """
        if rows.numel() == logits.shape[0]:
            candidates = top_k_top_p_candidates(logits, k, p)
        else:
            candidates = top_k_top_p_candidates(logits[rows], _take(k, rows), _take(p, rows))
        final = candidates.is_final
        final_rows = rows[final]
        if final_rows.numel():
            positions = _inverse_cdf(candidates.values[final], uniforms[final_rows])
            tokens[final_rows] = candidates.indices[final].gather(1, positions).squeeze(1)
        return final_rows

    @staticmethod
    def _uniforms(num_rows: int, metadata: SamplingMetadata,
                  device: torch.device) -> torch.Tensor:
        """``[num_rows]`` float64 uniforms; seeded, complete rows from their generator."""
        generators = metadata.generators
        is_partial = metadata.is_partial
        if len(generators) == num_rows and not is_partial.any():
            return torch.cat([draw_uniform(generators[row], device) for row in range(num_rows)])
        uniforms = torch.rand(num_rows, dtype=torch.float64, device=device)
        for row, generator in generators.items():
            if not is_partial[row]:
                uniforms[row] = draw_uniform(generator, device)[0]
        return uniforms


def _take(values: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    return None if values is None else values[rows]


def _inverse_cdf(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the position ``i`` with ``cdf[i-1] <= u * total < cdf[i]``.

    Args:
        logits: ``[rows, n]`` float logits (``-inf`` = probability 0); overwritten.
        uniforms: ``[rows]`` float64 uniforms in [0, 1).

    Returns:
        ``[rows, 1]`` int64 positions, each of a token with non-zero probability.
    """
    weights = logits.sub_(logits.amax(dim=1, keepdim=True)).exp_()
    cdf = weights.cumsum(dim=1)
    total = cdf[:, -1:]
    target = (uniforms.unsqueeze(1) * total).to(cdf.dtype)
    # Rounding must not push the target onto the total: the first entry above it then
    # always starts a token of non-zero probability.
    target = torch.minimum(target, total.nextafter(torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).clamp_(max=logits.shape[1] - 1)
