"""The worker: persistent input batch, model runner and sampling for one device."""

from engine.core.worker.input_batch import CachedRequestState, InputBatch

__all__ = ["CachedRequestState", "InputBatch"]
