"""Kernels chosen by measuring them on this machine (``--kernel-selection measured``).

Where several installed kernels can run a layer, the engine times the eligible ones on the
layer's own shape at the row counts steps have (``buckets``), keeps the fastest per row
bucket (``plan``), and stores the decision on disk keyed by everything it depends on
(``store``), so a later start reads it back instead of measuring. A layer whose buckets
chose different kernels runs them behind one dispatching kernel (``row_dispatch``).
"""

from __future__ import annotations

from typing import Literal

#: The values of ``--kernel-selection``: ``measured`` (this package) or ``priority`` (the
#: first kernel in priority order that can run a layer).
KernelSelection = Literal["measured", "priority"]
