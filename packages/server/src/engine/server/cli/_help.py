"""Help text that shows every option's default exactly once.

An option's help either says its default in its own words (it contains ``default:``), or
gets ``(default: X)`` appended here. Flags that are off unless given, and options whose
default is "nothing" (None, an empty list), get nothing appended.
"""

from __future__ import annotations

import argparse
from typing import Any


def describe_default(value: Any) -> str:
    """How a default reads in help text: ``on``/``off``, ``none``, ``a,b``, or the value."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None:
        return "none"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value) or "none"
    return str(value)


def with_default(help_text: str, default: Any) -> str:
    """``help_text`` plus ``(default: X)``, unless it already says its default.

    The result is escaped for argparse (``%`` doubled): ``help_text`` is plain text.
    """
    if "default:" not in help_text.lower():
        help_text = f"{help_text} (default: {describe_default(default)})"
    return help_text.replace("%", "%%")


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, adding ``(default: X)`` where an option's help lacks it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        if text is None or text is argparse.SUPPRESS:
            return text
        default = action.default
        if ("default:" in text.lower() or default is None or default is argparse.SUPPRESS
                or default is False or default in ("", [], ())):
            return text
        return f"{text} (default: %(default)s)"
