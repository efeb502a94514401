"""The garbage collector in the engine's own processes: start-up, then a frozen heap.

Start-up (importing torch and transformers, building the model) grows the heap to ~330k
objects the collector tracks. On the way, CPython runs a full collection each time the
long-lived objects grow by a quarter: five passes over an ever larger heap, ~0.4 s of a
2-core machine's start-up per process. Once serving, every full collection walks that
whole heap again (~0.2 s, measured) and stalls whichever step it lands on.

So the processes the engine starts (``engine serve``'s, EngineCore's, each worker's) call
:func:`defer_full_collections` first and :func:`freeze_startup_heap` once they are ready:
young collections go on as usual throughout; the objects alive at the freeze move to the
permanent generation (:func:`gc.freeze`), which later full collections skip, and the
thresholds come back. vLLM freezes its EngineCore's start-up heap the same way.

What the freeze keeps: cyclic garbage made during start-up that had already reached the
oldest generation (measured on the benchmark model: ~150 small objects, closures and
tuples, no tensors). A full collection before the freeze would find it, for ~0.2 s more
start-up; the young generations are collected first, which is free. A process that embeds
the engine (``LLM(...)`` in a user's program) is left alone: its heap is its own.
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)

#: Full collections wait for this many young-generation collections during start-up
#: (CPython's default is 10): in effect, none happen.
_STARTUP_THRESHOLD = 1 << 30

_saved: tuple[int, int, int] | None = None


def defer_full_collections() -> None:
    """No full collections until :func:`freeze_startup_heap` (young ones go on)."""
    global _saved
    if _saved is not None:
        return
    _saved = gc.get_threshold()
    gc.set_threshold(_saved[0], _saved[1], _STARTUP_THRESHOLD)


def freeze_startup_heap() -> None:
    """Collect the young generations, freeze every object alive, restore the thresholds.

    Idempotent; without :func:`defer_full_collections` first it freezes all the same.
    """
    collected = gc.collect(1)
    gc.freeze()
    restore_full_collections()
    logger.debug("start-up heap frozen: %d objects (%d young garbage collected first)",
                 gc.get_freeze_count(), collected)


def restore_full_collections() -> None:
    """Undo :func:`defer_full_collections` without a freeze (start-up stopped early)."""
    global _saved
    if _saved is not None:
        gc.set_threshold(*_saved)
        _saved = None


__all__ = ["defer_full_collections", "freeze_startup_heap", "restore_full_collections"]
