"""A logits processor that bans one token id per request, from ``extra_args["ban_token"]``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.sdk import SamplingParams, ValidationError
from engine.sdk.logits_processor import (
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessorContext,
    process_dict_updates,
)

if TYPE_CHECKING:
    import torch


class BanTokenProcessor(LogitsProcessor):
    """Sets the logit of ``extra_args["ban_token"]`` to -inf for requests that pass it."""

    def __init__(self, ctx: LogitsProcessorContext) -> None:
        self.vocab_size = ctx.vocab_size
        self.banned: dict[int, int] = {}

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        value = (params.extra_args or {}).get("ban_token")
        if value is not None and (not isinstance(value, int) or value < 0):
            raise ValidationError(
                f"extra_args.ban_token must be a token id (integer >= 0), got {value!r}",
                param="extra_args.ban_token",
            )

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(
            self.banned, batch_update,
            lambda params, _prompt, _out: (params.extra_args or {}).get("ban_token"),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, token in self.banned.items():
            logits[index, token] = float("-inf")
        return logits
