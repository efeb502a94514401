"""Row buckets: the step sizes a linear layer's kernel is measured and chosen for.

A step multiplies as many rows as it has tokens: 1-4 for decode steps of small batches,
tens for a batch of decodes, hundreds for a prefill chunk. Kernels differ most between
these (a kernel streaming the weight once wins at 1 row, a blocked matmul at 64, another
at 512), so each bucket gets its own choice. A bucket covers the row counts up to its
``upper`` bound (the last one every larger count) and is timed at ``rows``.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

#: The upper bounds of the buckets below the last one.
UPPER_BOUNDS = (1, 4, 64)
#: The most rows the last bucket is timed at (a larger token budget changes little: a
#: product of this many rows is bound by compute, as one of more is).
MAX_CHUNK_ROWS = 1024


@dataclass(frozen=True)
class RowBucket:
    """Row counts ``lower..upper`` (``upper`` None: no bound), timed at ``rows``."""

    lower: int
    upper: int | None
    rows: int

    def describe(self) -> str:
        if self.upper is None:
            return f"{self.lower}+ rows"
        if self.lower == self.upper:
            return f"{self.lower} row" + ("s" if self.lower > 1 else "")
        return f"{self.lower}-{self.upper} rows"


def row_buckets(step_tokens: int) -> tuple[RowBucket, ...]:
    """The buckets for steps of at most ``step_tokens`` tokens (the token budget)."""
    bounds = [b for b in UPPER_BOUNDS if b < step_tokens]
    buckets, lower = [], 1
    for bound in bounds:
        buckets.append(RowBucket(lower, bound, bound))
        lower = bound + 1
    last = max(lower, min(step_tokens, MAX_CHUNK_ROWS))
    buckets.append(RowBucket(lower, None, last))
    return tuple(buckets)


def bucket_triples(buckets: Sequence[RowBucket]) -> list[list[int | None]]:
    """``[[lower, upper, rows], ...]``: the buckets as a record and a decision's key hold them."""
    return [[b.lower, b.upper, b.rows] for b in buckets]


def upper_bounds(buckets: Sequence[RowBucket]) -> list[int]:
    """The bounds ``bucket_index`` looks ``rows`` up in (all buckets but the last)."""
    return [b.upper or 0 for b in buckets[:-1]]


def bucket_index(uppers: Sequence[int], rows: int) -> int:
    """The index of the bucket holding ``rows``, given ``upper_bounds(buckets)``."""
    return bisect.bisect_left(uppers, rows)
