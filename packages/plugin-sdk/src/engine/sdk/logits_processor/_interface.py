"""``LogitsProcessor``: the contract of a batch-level logits processor.

.. versionadded:: 1.0
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.sdk.context import PluginContext
from engine.sdk.logits_processor._batch_update import BatchUpdate
from engine.sdk.plugin import Plugin
from engine.sdk.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

__all__ = ["LogitsProcessor", "LogitsProcessorContext"]


@dataclass(frozen=True, kw_only=True)
class LogitsProcessorContext(PluginContext):
    """What a logits processor is told at construction.

    Attributes:
        device: The device the logits live on, as a torch device string (``"cpu"``,
            ``"cuda:0"``). Allocate per-batch tensors there.
        max_num_reqs: Most requests in the batch: every slot index is below it, so a
            tensor of ``max_num_reqs`` rows can hold per-slot values.
        vocab_size: Number of columns of the logits (may exceed the tokenizer's
            vocabulary when the model pads its output layer).
        is_pin_memory: Whether pinned host memory is available for asynchronous
            host-to-device copies (False on CPU).
        eos_token_id: The model's end-of-sequence token id, or None when unknown (a
            request's own ``stop_token_ids`` are in its ``SamplingParams``).

    .. versionadded:: 1.0
    """

    device: str = "cpu"
    max_num_reqs: int
    vocab_size: int
    is_pin_memory: bool = False
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_reqs", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LogitsProcessorContext.{name} must be an int >= 1, got "
                                 f"{value!r}")


class LogitsProcessor(Plugin, ABC):
    """Changes the logits of the requests that ask for it, for the whole batch at once.

    A processor is loaded by every worker (entry-point group
    ``engine.logits_processors``) and applies only to the requests that use it, usually
    those carrying its key in ``SamplingParams.extra_args``; every other row of the logits
    must come back unchanged. The engine calls it in this order::

        front end, per request:  cls.validate_params(params)        -> HTTP 400 on error
        worker, at start-up:     proc = cls(ctx)
        worker, every step:      proc.update_state(batch_update or None)
                                 logits = proc.apply(logits)         (see below)

    Call sites of ``apply``, one per step:

    * ``is_argmax_invariant() is False``: on the raw logits of every request, greedy ones
      included, before penalties, temperature and the sampler's own filters;
    * ``is_argmax_invariant() is True``: on the random-sampling path only, after penalties
      and temperature, just before the token is drawn. Rows of greedy requests may be
      present and their result is ignored; when every request in the batch is greedy
      ``apply`` is skipped for that step (``update_state`` is still called).

    Per-request state lives in slots (row ``i`` of the logits is slot ``i``) which move
    as requests come and go; :class:`~engine.sdk.logits_processor.BatchUpdate` says how.
    Keep a ``slot -> state`` dict with
    :func:`~engine.sdk.logits_processor.process_dict_updates`, or subclass
    :class:`~engine.sdk.logits_processor.PerRequestLogitsProcessor` and never see slots.

    Example (bans the token ids a request lists in ``extra_args["ban_tokens"]``)::

        class BanTokens(LogitsProcessor):
            @classmethod
            def validate_params(cls, params: SamplingParams) -> None:
                ids = (params.extra_args or {}).get("ban_tokens")
                if ids is not None and not (
                    isinstance(ids, list) and all(type(i) is int and i >= 0 for i in ids)
                ):
                    raise ValidationError("ban_tokens must be a list of token ids",
                                          param="extra_args.ban_tokens")

            def __init__(self, ctx: LogitsProcessorContext) -> None:
                super().__init__(ctx)
                self.slot_to_ids: dict[int, list[int]] = {}

            def is_argmax_invariant(self) -> bool:
                return False  # banning the top token changes the argmax

            def update_state(self, batch_update: BatchUpdate | None) -> None:
                process_dict_updates(self.slot_to_ids, batch_update, self._new_state)

            def _new_state(self, params, prompt_ids, output_ids) -> list[int] | None:
                ids = (params.extra_args or {}).get("ban_tokens") or ()
                ids = [i for i in ids if i < self.ctx.vocab_size]
                return ids or None  # None: this request does not use the processor

            def apply(self, logits: torch.Tensor) -> torch.Tensor:
                for slot, ids in self.slot_to_ids.items():
                    logits[slot, ids] = float("-inf")
                return logits

    Attributes:
        ctx: The context given at construction.

    .. versionadded:: 1.0
    """

    def __init__(self, ctx: LogitsProcessorContext) -> None:
        """Build the processor for one worker.

        Called: once per worker process, at start-up, after the model is loaded and before
        the first step; in the worker's main thread.

        Args:
            ctx: Device, batch capacity, vocabulary size and the validated ``Options``.

        Raises:
            ValidationError: ``ctx.options`` are unusable (start-up stops with the message).

        Must: call ``super().__init__(ctx)`` when overridden. May: allocate tensors of
        ``ctx.max_num_reqs`` rows on ``ctx.device``.

        .. versionadded:: 1.0
        """
        self.ctx = ctx

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        """Reject a request whose parameters for this processor are invalid.

        Called: in the front-end process, once per incoming request, before it is
        accepted; for every loaded processor, whether or not the request uses it. No
        instance exists there: this is a classmethod and sees no context.

        Args:
            params: The request's sampling parameters; this processor's keys are in
                ``params.extra_args`` (which may be None).

        Raises:
            ValidationError: A parameter is invalid; the client gets HTTP 400 with the
                message and ``param`` (e.g. ``"extra_args.ban_tokens"``).

        Must: return quietly when the request does not use the processor; be cheap and
        free of side effects. Values that depend on the model (a token id beyond
        ``vocab_size``) cannot be checked here: the worker side must tolerate them.
        Default: accepts everything.

        The keys of ``extra_args`` it reads are keys the processor takes: the front end
        refuses a key that no plugin takes (or declares in ``extra_args_keys``).

        .. versionadded:: 1.0
        """

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """Whether ``apply`` never changes which token has the largest logit in any row.

        Called: by the worker when it builds the sampling pipeline; the answer must not
        change afterwards. It picks the call site of ``apply`` (see the class docstring).

        Returns:
            True for filters that only lower non-maximal logits (top-k or min-p style),
            False for anything that can change the greedy choice (bans, biases).

        Must: return False unless the invariant holds for every row and every input;
        a wrong True makes greedy requests ignore the processor.

        .. versionadded:: 1.0
        """

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Bring per-slot state up to date with the batch about to be processed.

        Called: in the worker, exactly once per step that runs the model, before
        ``apply`` (and also on steps where ``apply`` is skipped); never concurrently.

        Args:
            batch_update: What changed since the previous call, to be applied removed ->
                added -> moved; None when no request entered, left or moved (generated
                tokens still grew: the ``output_token_ids`` lists are live).

        Must: apply the whole update, in order, even when none of the requests involved
        uses the processor (a slot it knows may have been reused or moved); never modify
        ``AddedRequest.output_token_ids``. May: keep references to the added requests'
        ``params`` and ``output_token_ids``.

        .. versionadded:: 1.0
        """

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Process the logits of the whole batch.

        Called: in the worker, once per step after ``update_state``, at the call site
        chosen by :meth:`is_argmax_invariant`; never concurrently.

        Args:
            logits: Floating-point tensor of shape ``[batch_size, vocab_size]`` on
                ``ctx.device``; row ``i`` belongs to the request in slot ``i``.

        Returns:
            The logits to use from now on: ``logits`` itself modified in place, or a new
            tensor of the same shape, dtype and device.

        Must: leave the rows of requests that do not use the processor unchanged; give
        each request the same result whatever else is in the batch and wherever its slot
        is; not keep a reference to ``logits`` after returning. Should: avoid copying to
        the host (it stalls the device), e.g. by caching per-slot tensors that are
        rebuilt only when ``update_state`` changed something.

        .. versionadded:: 1.0
        """
