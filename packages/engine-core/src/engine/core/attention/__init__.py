"""Built-in attention backends (entries of ``engine.attention_backends`` in engine-core)."""

from engine.core.attention.cpu_backend import CpuAttentionBackend
from engine.core.attention.torch_backend import TorchAttentionBackend

__all__ = ["CpuAttentionBackend", "TorchAttentionBackend"]
