"""``PerRequestLogitsProcessor``: write one function per request, never see slots.

.. versionadded:: 1.0
"""

from __future__ import annotations

import inspect
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

from engine.sdk.errors import PluginError
from engine.sdk.groups import LOGITS_PROCESSORS
from engine.sdk.logits_processor._batch_update import (
    BatchUpdate,
    MoveDirectionality,
    process_dict_updates,
)
from engine.sdk.logits_processor._interface import LogitsProcessor, LogitsProcessorContext
from engine.sdk.logits_processor._rows_failed import RowsFailedError
from engine.sdk.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

__all__ = ["PerRequestLogitsProcessor", "RequestLogitsProcessor"]

#: The function a :class:`PerRequestLogitsProcessor` returns for one request: either
#: ``fn(output_token_ids, logits_row) -> logits_row`` or
#: ``fn(prompt_token_ids, output_token_ids, logits_row) -> logits_row``. ``logits_row`` is
#: the request's row of shape ``[vocab_size]`` (a view: modifying it in place and returning
#: it is the cheapest); ``output_token_ids`` is the live list of generated tokens (read
#: only); ``prompt_token_ids`` is a tuple, or None for a prompt given as embeddings.
RequestLogitsProcessor: TypeAlias = (
    Callable[[list[int], "torch.Tensor"], "torch.Tensor"]
    | Callable[[tuple[int, ...] | None, list[int], "torch.Tensor"], "torch.Tensor"]
)

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


@dataclass(frozen=True)
class _RequestEntry:
    fn: Callable[..., torch.Tensor]
    takes_prompt: bool
    prompt_token_ids: tuple[int, ...] | None
    output_token_ids: list[int]


def _takes_prompt(fn: Callable[..., Any]) -> bool | str:
    """True for a 3-argument function, False for a 2-argument one, else why neither."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        return f"its signature cannot be inspected ({exc}); wrap it in a def"
    params = list(signature.parameters.values())
    if any(p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is p.empty for p in params):
        return "it has required keyword-only parameters"
    positional = [p for p in params if p.kind in _POSITIONAL]
    required = sum(1 for p in positional if p.default is p.empty)
    has_var = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    accepted = float("inf") if has_var else len(positional)
    if required > 3 or accepted < 2:
        return f"it takes {required} required positional argument(s), not 2 or 3"
    if required in (2, 3):
        return required == 3
    return accepted >= 3


class PerRequestLogitsProcessor(LogitsProcessor):
    """Adapter: the author returns one function per request; the adapter handles slots.

    Implement :meth:`new_req_logits_processor`: given a request's sampling parameters, it
    returns the function to apply to that request's logits row at every step (see
    :data:`RequestLogitsProcessor`), or None when the request does not use the
    processor. The adapter follows the request through every slot change and calls the
    function on the right row; it is simpler than a batch-level processor and slower
    (one Python call per using request per step).

    The function's arity is detected once per request: two required positional
    parameters mean ``(output_token_ids, logits_row)``, three mean
    ``(prompt_token_ids, output_token_ids, logits_row)``.

    Example (the same ban as :class:`LogitsProcessor`'s example)::

        class BanTokens(PerRequestLogitsProcessor):
            @classmethod
            def validate_params(cls, params: SamplingParams) -> None:
                ...  # as in the LogitsProcessor example

            def new_req_logits_processor(self, params):
                ids = (params.extra_args or {}).get("ban_tokens") or ()
                ids = [i for i in ids if i < self.ctx.vocab_size]
                if not ids:
                    return None  # the request does not use this processor

                def ban(output_token_ids: list[int], row: torch.Tensor) -> torch.Tensor:
                    row[ids] = float("-inf")
                    return row

                return ban

    ``is_argmax_invariant`` returns False; override it only when every function the
    processor returns keeps the argmax of its row.

    .. versionadded:: 1.0
    """

    def __init__(self, ctx: LogitsProcessorContext) -> None:
        """Build the adapter (see :meth:`LogitsProcessor.__init__`).

        Must: be called by a subclass that overrides ``__init__``.

        .. versionadded:: 1.0
        """
        super().__init__(ctx)
        self._slot_to_entry: dict[int, _RequestEntry] = {}

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        """Return the function to apply to a new request's logits, or None to skip it.

        Called: in the worker, from ``update_state``, once each time a request enters the
        batch (again when a preempted request resumes).

        Args:
            params: The request's sampling parameters (already checked by
                ``validate_params``).

        Returns:
            A :data:`RequestLogitsProcessor`, called once per step on the request's row;
            or None when the request does not use the processor.

        Must: return a new function (or an immutable one) per request when it carries
        per-request state; never modify the token id lists it is given.

        .. versionadded:: 1.0
        """

    def is_argmax_invariant(self) -> bool:
        """False: per-request functions are assumed able to change the argmax.

        .. versionadded:: 1.0
        """
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Follow the batch's slot changes (see :meth:`LogitsProcessor.update_state`).

        Raises:
            RowsFailedError: :meth:`new_req_logits_processor` raised, or returned something
                that is not a 2- or 3-argument callable, for some added requests (since
                1.1; the whole update is applied first, those slots get no function).

        .. versionadded:: 1.0
        """
        if batch_update is None:
            return
        entries: list[_RequestEntry | None] = []
        failed: dict[int, BaseException] = {}
        for added in batch_update.added:
            try:
                entries.append(self._new_entry(added.params, added.prompt_token_ids,
                                               added.output_token_ids))
            except Exception as exc:  # noqa: BLE001 - that one request fails, not the batch
                entries.append(None)
                failed[added.index] = exc
        made = iter(entries)
        process_dict_updates(self._slot_to_entry, batch_update, lambda *_: next(made))
        if failed:
            raise RowsFailedError(_follow_moves(failed, batch_update))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Call each using request's function on its row (see :meth:`LogitsProcessor.apply`).

        Raises:
            RowsFailedError: some requests' functions raised (since 1.1); every other row
                is processed, and only those requests fail.

        .. versionadded:: 1.0
        """
        failed: dict[int, BaseException] = {}
        for index, entry in self._slot_to_entry.items():
            row = logits[index]
            try:
                if entry.takes_prompt:
                    out = entry.fn(entry.prompt_token_ids, entry.output_token_ids, row)
                else:
                    out = entry.fn(entry.output_token_ids, row)
            except Exception as exc:  # noqa: BLE001 - that one request fails, not the batch
                failed[index] = exc
                continue
            if out is not row:
                logits[index] = out
        if failed:
            raise RowsFailedError(failed, logits)
        return logits

    def _new_entry(
        self,
        params: SamplingParams,
        prompt_token_ids: tuple[int, ...] | None,
        output_token_ids: list[int],
    ) -> _RequestEntry | None:
        fn = self.new_req_logits_processor(params)
        if fn is None:
            return None
        takes_prompt = _takes_prompt(fn) if callable(fn) else "it is not callable"
        if isinstance(takes_prompt, str):
            raise PluginError(
                f"logits processor {self.ctx.plugin_name or type(self).__qualname__!r}: "
                f"{type(self).__qualname__}.new_req_logits_processor returned {fn!r}, which "
                f"cannot be used as a request logits processor: {takes_prompt}; expected "
                f"fn(output_token_ids, logits_row) or "
                f"fn(prompt_token_ids, output_token_ids, logits_row) (group "
                f"{LOGITS_PROCESSORS})"
            )
        return _RequestEntry(fn, takes_prompt, prompt_token_ids, output_token_ids)


def _follow_moves(slots: dict[int, BaseException],
                  batch_update: BatchUpdate) -> dict[int, BaseException]:
    """Where the added slots in ``slots`` are once ``batch_update``'s moves are applied."""
    result = dict(slots)
    for move in batch_update.moved:
        src, dst = move.from_index, move.to_index
        if src == dst:
            continue
        src_value, dst_value = result.pop(src, None), result.pop(dst, None)
        if src_value is not None:
            result[dst] = src_value
        if dst_value is not None and move.directionality is MoveDirectionality.SWAP:
            result[src] = dst_value
    return result
