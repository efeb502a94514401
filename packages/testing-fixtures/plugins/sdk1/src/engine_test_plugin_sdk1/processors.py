"""Logits-processor plugin: forbid repeating any of a request's last N generated tokens.

A request opts in with ``extra_args["sdk1_no_repeat"] = N`` (an integer in [1, 1024]);
every other request is untouched. ``Options.max_window`` caps N for the whole engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from engine.sdk import (
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessorContext,
    PluginOptions,
    SamplingParams,
    ValidationError,
    process_dict_updates,
)
from engine_test_plugin_sdk1.counters import count

if TYPE_CHECKING:
    import torch

KEY = "sdk1_no_repeat"
MAX_WINDOW = 1024


def window_of(params: SamplingParams) -> int | None:
    """The request's window, or None when it does not use this processor."""
    value = (params.extra_args or {}).get(KEY)
    return None if value is None else int(value)


class Sdk1NoRepeat(LogitsProcessor):
    class Options(PluginOptions):
        max_window: int = Field(MAX_WINDOW, ge=1, le=MAX_WINDOW,
                                description="the largest window a request gets")

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        value = (params.extra_args or {}).get(KEY)
        if value is None:
            return  # not used by this request
        if type(value) is not int or not 1 <= value <= MAX_WINDOW:
            raise ValidationError(
                f"{KEY} must be an integer in [1, {MAX_WINDOW}], got {value!r}",
                param=f"extra_args.{KEY}")

    def __init__(self, ctx: LogitsProcessorContext) -> None:
        super().__init__(ctx)
        options = ctx.options
        if not isinstance(options, Sdk1NoRepeat.Options):
            options = Sdk1NoRepeat.Options()  # built outside the engine
        self.max_window = options.max_window
        # slot -> (window, the request's live output_token_ids)
        self.slot_to_state: dict[int, tuple[int, list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # banning the top token changes the greedy choice

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        count("sdk1_no_repeat.update_state")
        process_dict_updates(self.slot_to_state, batch_update, self._new_state)

    def _new_state(
        self, params: SamplingParams, prompt_ids: tuple[int, ...] | None, output_ids: list[int]
    ) -> tuple[int, list[int]] | None:
        window = window_of(params)
        return None if window is None else (min(window, self.max_window), output_ids)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        count("sdk1_no_repeat.apply")
        for slot, (window, output_ids) in self.slot_to_state.items():
            recent = [t for t in output_ids[-window:] if 0 <= t < self.ctx.vocab_size]
            if recent:
                count("sdk1_no_repeat.rows_changed")
                logits[slot, recent] = float("-inf")
        return logits
