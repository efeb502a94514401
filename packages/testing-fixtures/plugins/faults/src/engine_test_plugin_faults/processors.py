"""Logits processors that raise for the requests that ask them to."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.sdk import SamplingParams
from engine.sdk.logits_processor import (
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessorContext,
    PerRequestLogitsProcessor,
    RequestLogitsProcessor,
    RowsFailedError,
    process_dict_updates,
)
from engine_test_plugin_faults import CALLS

if TYPE_CHECKING:
    import torch


class RequestFault(PerRequestLogitsProcessor):
    """``extra_args["fault"]``: ``"apply"``, ``"update_state"`` or ``"none"``."""

    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        fault = (params.extra_args or {}).get("fault")
        if fault is None:
            return None
        CALLS["test_fault_request.new_req_logits_processor"] += 1
        if fault == "update_state":
            raise RuntimeError("test_fault_request refused this request")

        def process(output_token_ids: list[int], row: torch.Tensor) -> torch.Tensor:
            CALLS["test_fault_request.apply"] += 1
            if fault == "apply":
                raise ZeroDivisionError("test_fault_request divided by zero")
            return row

        return process


class BatchFault(LogitsProcessor):
    """``extra_args["fault_batch"]``: ``"raise"`` (plain error) or ``"rows"`` (its row only)."""

    def __init__(self, ctx: LogitsProcessorContext) -> None:
        super().__init__(ctx)
        self.modes: dict[int, str] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.modes, batch_update,
                             lambda params, _p, _o: (params.extra_args or {}).get("fault_batch"))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        CALLS["test_fault_batch.apply"] += 1
        if "raise" in self.modes.values():
            raise RuntimeError("test_fault_batch broke the batch")
        rows = {slot: "test_fault_batch failed this row" for slot, mode in self.modes.items()
                if mode == "rows"}
        if rows:
            raise RowsFailedError(rows, logits)
        return logits
