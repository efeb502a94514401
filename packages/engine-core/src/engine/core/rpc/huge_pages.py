"""Transparent huge pages for the EngineCore process's memory (Linux, glibc).

A CPU decode step streams every weight from memory once; at batch 1 it is bound by how
fast memory reads. With 4 KiB pages a pass over the 100M benchmark model's 192 MB touches
~47 000 pages, each needing a TLB entry (and, in a VM, a nested page walk); with 2 MiB
pages, ~100. Measured on a 2-core Zen 4 VM (``benchmarks/huge_pages.py``, numbers in
``benchmarks/README.md``, runs 21-22): the small-batch product over the model's weights
reads 1.17x faster (median of 15 interleaved pairs in one process), and the step graph of
a batch-1 decode step takes ~5% less time (6.40-6.63 ms against 6.73-7.07).

Most Linux machines run THP in ``madvise`` mode: only memory asked for gets huge pages.
glibc's ``malloc`` asks for every chunk it maps when the tunable ``glibc.malloc.hugetlb=1``
is set (glibc 2.35+; older versions and other C libraries ignore it), which must be in the
environment when a process starts. So the EngineCore process is spawned with it, and
its worker processes inherit it: the weights, the packed copies the linear kernels make,
the KV cache and the step's buffers all come from huge-page-backed ``malloc``. The
resident memory grows a little (~5% for the benchmark model: partly used 2 MiB pages).

An operator whose ``GLIBC_TUNABLES`` already sets ``glibc.malloc.hugetlb`` keeps their
value (``glibc.malloc.hugetlb=0`` turns this off). An EngineCore run in the calling
process (``LLM(in_process=True)``) keeps that process's allocator as it started.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

#: The glibc tunable that makes ``malloc`` ask for transparent huge pages.
TUNABLE = "glibc.malloc.hugetlb"


def tunables_with_huge_pages(current: str | None) -> str:
    """``GLIBC_TUNABLES`` with ``glibc.malloc.hugetlb=1`` added, unless it is set already."""
    entries = [e for e in (current or "").split(":") if e]
    if any(e.split("=", 1)[0] == TUNABLE for e in entries):
        return ":".join(entries)
    return ":".join([*entries, f"{TUNABLE}=1"])


@contextlib.contextmanager
def huge_page_malloc() -> Iterator[None]:
    """Processes started inside get ``glibc.malloc.hugetlb=1`` (Linux; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        yield
        return
    before = os.environ.get("GLIBC_TUNABLES")
    os.environ["GLIBC_TUNABLES"] = tunables_with_huge_pages(before)
    try:
        yield
    finally:
        if before is None:
            del os.environ["GLIBC_TUNABLES"]
        else:
            os.environ["GLIBC_TUNABLES"] = before


__all__ = ["TUNABLE", "huge_page_malloc", "tunables_with_huge_pages"]
