"""What the plugins of this distribution did in this process, for tests to read.

Keys are ``"<plugin>.<event>"`` (e.g. ``"sdk1_paged.forward"``). Counters only grow;
tests compare before and after.
"""

from __future__ import annotations

from collections import Counter

CALLS: Counter[str] = Counter()


def count(event: str, n: int = 1) -> None:
    """Add ``n`` to ``event``."""
    CALLS[event] += n
