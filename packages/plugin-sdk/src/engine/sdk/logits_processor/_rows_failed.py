"""``RowsFailedError``: a logits processor failed for some requests of the batch only."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from engine.sdk.errors import PluginError

if TYPE_CHECKING:
    import torch


class RowsFailedError(PluginError):
    """Raised by ``apply`` or ``update_state`` when only some rows' requests failed.

    Any other exception from ``apply`` fails every request of the step (the engine cannot
    tell which rows it concerned). Raising this instead fails only the requests of
    ``rows``; each ends with finish reason ``"error"`` and a message naming the processor
    and its distribution, everyone else is served.
    :class:`~engine.sdk.logits_processor.PerRequestLogitsProcessor` raises it for you
    when one request's function raises.

    Args:
        rows: Slot index -> what went wrong there (the exception, or a message).
        logits: From ``apply``: the batch's logits with every other row processed (the
            engine samples from them). None from ``update_state``, or when ``apply`` did
            not get that far: the engine then uses the logits it passed in, so ``apply``
            must have left the other rows as they were or processed them in place.

    Must (from ``update_state``): have applied the whole update first, so the state of
    the other slots is correct.

    A :class:`~engine.sdk.errors.PluginError`: its message starts with the number of
    failed rows and quotes the first one's cause.

    .. versionadded:: 1.1
    """

    def __init__(self, rows: Mapping[int, BaseException | str],
                 logits: torch.Tensor | None = None) -> None:
        self.rows = dict(rows)
        self.logits = logits
        first = next(iter(self.rows.items()), None)
        detail = "" if first is None else f"; slot {first[0]}: {describe(first[1])}"
        super().__init__(f"{len(self.rows)} row(s) failed{detail}")

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.rows, self.logits))


def describe(cause: BaseException | str) -> str:
    """``"ZeroDivisionError: division by zero"`` for an exception; a message as it is."""
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}"
    return cause
