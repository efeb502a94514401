"""engine-kernels' custom ops (``engine.custom_ops``): C++ CPU paths and Triton CUDA paths."""

from engine.kernels.ops.replacements import (
    FusedMoE,
    GeluAndMul,
    RMSNorm,
    RotaryEmbedding,
    SiluAndMul,
)

__all__ = ["FusedMoE", "GeluAndMul", "RMSNorm", "RotaryEmbedding", "SiluAndMul"]
