"""Custom-op replacements with Triton CUDA paths (``engine.custom_ops``)."""

from engine.kernels.ops.replacements import TritonRMSNorm, TritonRotaryEmbedding, TritonSiluAndMul

__all__ = ["TritonRMSNorm", "TritonRotaryEmbedding", "TritonSiluAndMul"]
