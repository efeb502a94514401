"""``engine.core.heap``: no full collections during start-up, then the heap frozen."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from engine.core import heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


@pytest.fixture(autouse=True)
def _restore_gc() -> Iterator[None]:
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)
    heap._saved = None


def test_start_up_defers_full_collections_only() -> None:
    young = gc.get_threshold()[:2]
    heap.defer_full_collections()
    assert gc.get_threshold()[:2] == young
    assert gc.get_threshold()[2] >= 1 << 30
    heap.defer_full_collections()  # twice: the first thresholds are the ones restored
    heap.freeze_startup_heap()
    assert gc.get_threshold()[:2] == young
    assert gc.get_threshold()[2] < 1 << 30


def test_the_freeze_keeps_live_objects_and_collects_young_garbage_first() -> None:
    heap.defer_full_collections()
    kept = _Node()
    garbage = weakref.ref(_Node())  # unreachable at once, still young at the freeze
    heap.freeze_startup_heap()
    assert garbage() is None
    # frozen: in the permanent generation, which collections (and get_objects) skip
    assert not any(obj is kept for obj in gc.get_objects())


def test_garbage_made_after_the_freeze_is_still_collected() -> None:
    heap.defer_full_collections()
    heap.freeze_startup_heap()
    later = weakref.ref(_Node())
    gc.collect()
    assert later() is None


def test_a_start_up_that_stops_early_gets_its_thresholds_back() -> None:
    thresholds = gc.get_threshold()
    heap.defer_full_collections()
    heap.restore_full_collections()
    assert gc.get_threshold() == thresholds
    assert gc.get_freeze_count() == 0
