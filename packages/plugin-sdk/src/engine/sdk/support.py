"""``Support``: the answer every "can you do this?" hook returns."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Support:
    """Whether something is supported, and if not, why.

    Every capability hook in the SDK (``AttentionBackend.supports``,
    ``QuantizationConfig.is_supported``, ``LinearKernel.can_implement``, ...) returns one,
    so the engine can show the operator each rejected candidate with its reason.

    Use :meth:`yes` and :meth:`no` to build one; ``bool(support)`` is ``support.ok``.

    Attributes:
        ok: True when supported.
        reason: Empty when ``ok``; otherwise one sentence an operator can act on, e.g.
            ``"head size 80 is not supported; supported: 64, 128, 256"``.

    .. versionadded:: 1.0
    """

    ok: bool
    reason: str = ""

    def __post_init__(self) -> None:
        if not self.ok and not self.reason:
            raise ValueError("Support(ok=False) needs a reason saying why it is not supported")

    def __bool__(self) -> bool:
        return self.ok

    @classmethod
    def yes(cls) -> Support:
        """Supported."""
        return cls(True, "")

    @classmethod
    def no(cls, reason: str) -> Support:
        """Not supported, because ``reason``."""
        return cls(False, reason)
