"""One rule for every captured forward pass: capture it, or log why the model runs eagerly.

Used by ``step_graph`` (the CPU) and ``cuda_graphs`` (CUDA).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def capture_or_explain(logger: logging.Logger, label: str, capture: Callable[[], T],
                       describe: Callable[[T], str], *, refused: type[Exception],
                       enforce_eager: bool, reasons: Sequence[str],
                       quiet: bool = False) -> T | None:
    """``capture()``, or None; one line (INFO, DEBUG if ``quiet``) on ``logger`` says which.

    None when ``enforce_eager`` is set, ``reasons`` has an entry (the first is logged) or
    ``capture`` raises ``refused`` (its message is logged). The lines:
    ``"{label}: {describe(captured)}; --enforce-eager turns it off"`` or
    ``"{label}: not used, the model runs eagerly ({why})"``.
    """
    level = logging.DEBUG if quiet else logging.INFO
    why = "--enforce-eager" if enforce_eager else next(iter(reasons), None)
    if why is None:
        try:
            captured = capture()
        except refused as exc:
            why = str(exc)
        else:
            logger.log(level, "%s: %s; --enforce-eager turns it off", label, describe(captured))
            return captured
    logger.log(level, "%s: not used, the model runs eagerly (%s)", label, why)
    return None


__all__ = ["capture_or_explain"]
