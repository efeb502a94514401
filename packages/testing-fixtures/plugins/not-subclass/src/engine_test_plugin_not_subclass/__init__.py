"""Entries that do not satisfy their group's contract."""

from __future__ import annotations

from engine.sdk.logits_processor import BatchUpdate, LogitsProcessor


class NotAProcessor:
    """Looks like a logits processor but does not subclass the SDK's ABC."""

    def apply(self, logits):  # type: ignore[no-untyped-def]
        return logits


class HalfAProcessor(LogitsProcessor):
    """Subclasses the ABC but forgets ``apply`` and ``is_argmax_invariant``."""

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass
