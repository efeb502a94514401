"""engine-kernels' custom ops (``engine.custom_ops``): C++ CPU paths and Triton CUDA paths."""

from engine.kernels.ops.replacements import (
    FusedMoE,
    RMSNorm,
    RotaryEmbedding,
    SiluAndMul,
)

__all__ = ["FusedMoE", "RMSNorm", "RotaryEmbedding", "SiluAndMul"]
