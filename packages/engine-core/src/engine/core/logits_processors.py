"""Built-in logits processors: ``min_tokens``, ``logit_bias`` and ``min_p``.

They are ordinary SDK :class:`~engine.sdk.logits_processor.LogitsProcessor` subclasses,
registered in engine-core's ``engine.logits_processors`` entry points like any plugin, and
keep their per-slot state with :func:`~engine.sdk.logits_processor.process_dict_updates`.
Each caches the index/value tensors it applies and rebuilds them only when its state
changed, so a step costs one indexed write (plus, for ``min_tokens``, one length check
per request that still has a minimum to reach).

This module sits outside ``sample/``: the front end loads these classes too (to run their
``validate_params``), and must not import the sampler.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from engine.sdk.logits_processor import (
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessorContext,
    process_dict_updates,
)
from engine.sdk.sampling_params import SamplingParams

__all__ = [
    "BUILTIN_LOGITS_PROCESSORS",
    "apply_min_p",
    "LogitBiasLogitsProcessor",
    "MinPLogitsProcessor",
    "MinTokensLogitsProcessor",
]

_NEG_INF = float("-inf")


class _BuiltinLogitsProcessor(LogitsProcessor):
    """A built-in processor: it reads ``SamplingParams`` fields, never ``extra_args``."""

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        """Accept every request: the SDK validated the fields this processor reads.

        Overriding the default says that this processor takes no ``extra_args`` keys, so
        it does not stop the front end from refusing keys that no processor takes (see
        :mod:`engine.core.frontend.extra_args`).
        """


@dataclass(frozen=True)
class _MinTokensState:
    min_tokens: int
    output_token_ids: list[int]  # live list: the engine appends to it
    banned_token_ids: tuple[int, ...]


class MinTokensLogitsProcessor(_BuiltinLogitsProcessor):
    """Suppress EOS and ``stop_token_ids`` until a request has ``min_tokens`` tokens.

    Uses ``SamplingParams.min_tokens`` and ``stop_token_ids``, and the context's
    ``eos_token_id`` (not banned when the request sets ``ignore_eos``). Not
    argmax-invariant: it applies to greedy requests too.
    """

    def __init__(self, ctx: LogitsProcessorContext) -> None:
        super().__init__(ctx)
        self._slot_to_state: dict[int, _MinTokensState] = {}
        self._active_slots: tuple[int, ...] = ()
        self._rows = torch.empty(0, dtype=torch.long, device=ctx.device)
        self._cols = torch.empty(0, dtype=torch.long, device=ctx.device)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if process_dict_updates(self._slot_to_state, batch_update, self._new_state):
            self._active_slots = ()  # slots changed: force an index rebuild in apply

    def _new_state(
        self, params: SamplingParams, prompt_token_ids: tuple[int, ...] | None,
        output_token_ids: list[int],
    ) -> _MinTokensState | None:
        if params.min_tokens <= 0:
            return None
        banned = set(params.stop_token_ids)
        eos_token_id = self.ctx.eos_token_id
        if eos_token_id is not None and not params.ignore_eos:
            banned.add(eos_token_id)
        banned_ids = tuple(sorted(t for t in banned if t < self.ctx.vocab_size))
        if not banned_ids or len(output_token_ids) >= params.min_tokens:
            return None
        return _MinTokensState(params.min_tokens, output_token_ids, banned_ids)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._slot_to_state:
            return logits
        finished = [slot for slot, state in self._slot_to_state.items()
                    if len(state.output_token_ids) >= state.min_tokens]
        for slot in finished:  # a request never falls below its minimum again
            del self._slot_to_state[slot]
        active = tuple(self._slot_to_state)
        if active != self._active_slots:
            self._rebuild(active)
        if active:
            logits[self._rows, self._cols] = _NEG_INF
        return logits

    def _rebuild(self, active: tuple[int, ...]) -> None:
        rows: list[int] = []
        cols: list[int] = []
        for slot in active:
            banned = self._slot_to_state[slot].banned_token_ids
            rows.extend([slot] * len(banned))
            cols.extend(banned)
        self._rows = torch.tensor(rows, dtype=torch.long).to(self.ctx.device)
        self._cols = torch.tensor(cols, dtype=torch.long).to(self.ctx.device)
        self._active_slots = active


class LogitBiasLogitsProcessor(_BuiltinLogitsProcessor):
    """Add ``SamplingParams.logit_bias`` (``{token_id: bias}``) to the request's logits.

    Token ids at or beyond the vocabulary size are ignored. Not argmax-invariant.
    """

    def __init__(self, ctx: LogitsProcessorContext) -> None:
        super().__init__(ctx)
        self._slot_to_bias: dict[int, Mapping[int, float]] = {}
        self._rows = torch.empty(0, dtype=torch.long, device=ctx.device)
        self._cols = torch.empty(0, dtype=torch.long, device=ctx.device)
        self._values = torch.empty(0, dtype=torch.float32, device=ctx.device)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if not process_dict_updates(self._slot_to_bias, batch_update, self._new_state):
            return
        rows: list[int] = []
        cols: list[int] = []
        values: list[float] = []
        for slot, bias in self._slot_to_bias.items():
            rows.extend([slot] * len(bias))
            cols.extend(bias.keys())
            values.extend(bias.values())
        device = self.ctx.device
        self._rows = torch.tensor(rows, dtype=torch.long).to(device)
        self._cols = torch.tensor(cols, dtype=torch.long).to(device)
        self._values = torch.tensor(values, dtype=torch.float32).to(device)

    def _new_state(
        self, params: SamplingParams, prompt_token_ids: tuple[int, ...] | None,
        output_token_ids: list[int],
    ) -> Mapping[int, float] | None:
        if not params.logit_bias:
            return None
        vocab_size = self.ctx.vocab_size
        bias = {int(t): float(b) for t, b in params.logit_bias.items() if t < vocab_size}
        return bias or None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self._rows.numel():
            values = self._values.to(logits.dtype)
            logits.index_put_((self._rows, self._cols), values, accumulate=True)
        return logits


class MinPLogitsProcessor(_BuiltinLogitsProcessor):
    """Drop tokens whose probability is below ``min_p`` times the most likely token's.

    Uses ``SamplingParams.min_p`` (0 disables). Argmax-invariant: it runs on the random
    path after temperature, on the rows that use it only.
    """

    def __init__(self, ctx: LogitsProcessorContext) -> None:
        super().__init__(ctx)
        self._slot_to_min_p: dict[int, float] = {}
        self._rows = torch.empty(0, dtype=torch.long, device=ctx.device)
        self._min_p = torch.empty(0, dtype=torch.float32, device=ctx.device)
        self._is_dense = False

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if not process_dict_updates(self._slot_to_min_p, batch_update, self._new_state):
            return
        slots = sorted(self._slot_to_min_p)
        device = self.ctx.device
        self._rows = torch.tensor(slots, dtype=torch.long).to(device)
        self._min_p = torch.tensor([self._slot_to_min_p[s] for s in slots],
                                   dtype=torch.float32).to(device)
        batch_size = batch_update.batch_size if batch_update is not None else -1
        self._is_dense = len(slots) == batch_size

    @staticmethod
    def _new_state(
        params: SamplingParams, prompt_token_ids: tuple[int, ...] | None,
        output_token_ids: list[int],
    ) -> float | None:
        return float(params.min_p) if params.min_p > 0 else None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._rows.numel():
            return logits
        if self._is_dense and logits.shape[0] == self._rows.numel():
            return apply_min_p(logits, self._min_p)
        logits[self._rows] = apply_min_p(logits[self._rows], self._min_p)
        return logits


#: The built-in processors in the order the engine applies them within each call site.
BUILTIN_LOGITS_PROCESSORS: tuple[type[LogitsProcessor], ...] = (
    MinTokensLogitsProcessor,
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
)

def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p[i]`` times row ``i``'s top one.

    ``p_i < min_p * p_max`` is ``logit_i < max_logit + log(min_p)``: no softmax needed.

    Args:
        logits: ``[rows, vocab]`` float logits (after temperature); modified in place.
        min_p: ``[rows]`` values in [0, 1]; 0 disables the filter for that row.

    Returns:
        ``logits`` with the masked entries set to ``-inf``.
    """
    log_min_p = torch.log(min_p.to(logits.dtype))  # log(0) = -inf: nothing masked
    cutoff = logits.amax(dim=1) + log_min_p
    return logits.masked_fill_(logits < cutoff.unsqueeze(1), _NEG_INF)
