"""``RowsFailedError``: a per-request function that raises fails its row, not the batch."""

from __future__ import annotations

import pytest
import torch

from engine.sdk.logits_processor import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessorContext,
    MoveDirectionality,
    MovedRequest,
    PerRequestLogitsProcessor,
    RequestLogitsProcessor,
    RowsFailedError,
)
from engine.sdk.sampling_params import SamplingParams


class Picky(PerRequestLogitsProcessor):
    """``extra_args["mode"]``: ``"add"`` (+1 on its row), ``"raise"`` (apply raises),
    ``"refuse"`` (new_req_logits_processor raises), ``"bad"`` (returns a non-callable)."""

    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        mode = (params.extra_args or {}).get("mode")
        if mode == "refuse":
            raise ValueError("refused")
        if mode == "bad":
            return 42  # type: ignore[return-value]
        if mode is None:
            return None

        def fn(output_token_ids: list[int], row: torch.Tensor) -> torch.Tensor:
            if mode == "raise":
                raise ZeroDivisionError("boom")
            return row.add_(1)

        return fn


def added(index: int, mode: str | None) -> AddedRequest:
    return AddedRequest(index, SamplingParams(extra_args={"mode": mode} if mode else None),
                        (1,), [])


def processor() -> Picky:
    return Picky(LogitsProcessorContext(max_num_reqs=4, vocab_size=3))


def test_apply_fails_only_the_raising_rows_and_processes_the_rest() -> None:
    proc = processor()
    proc.update_state(BatchUpdate(3, added=(added(0, "add"), added(1, "raise"), added(2, None))))
    with pytest.raises(RowsFailedError) as info:
        proc.apply(torch.zeros(3, 3))
    assert set(info.value.rows) == {1}
    assert isinstance(info.value.rows[1], ZeroDivisionError)
    assert info.value.logits is not None
    assert info.value.logits.tolist() == [[1, 1, 1], [0, 0, 0], [0, 0, 0]]


def test_update_state_applies_the_whole_update_then_names_the_failed_slots() -> None:
    proc = processor()
    update = BatchUpdate(3, added=(added(0, "refuse"), added(1, "add"), added(3, "bad")),
                         moved=(MovedRequest(3, 2, MoveDirectionality.MOVE),
                                MovedRequest(0, 1, MoveDirectionality.SWAP)))
    with pytest.raises(RowsFailedError) as info:
        proc.update_state(update)
    # slot 0's request moved to 1 (swapped with "add"), slot 3's to 2: the final slots.
    assert sorted(info.value.rows) == [1, 2]
    assert "refused" in str(info.value.rows[1])
    assert "cannot be used as a request logits processor" in str(info.value.rows[2])
    assert info.value.logits is None
    logits = proc.apply(torch.zeros(3, 3))  # the healthy request kept its function
    assert logits.tolist() == [[1, 1, 1], [0, 0, 0], [0, 0, 0]]
