"""The ``triton`` attention backend (``engine.attention_backends``), its kernels, references."""

from engine.kernels.attention.backend import TritonAttentionBackend

__all__ = ["TritonAttentionBackend"]
