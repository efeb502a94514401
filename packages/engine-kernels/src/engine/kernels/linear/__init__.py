"""Linear kernels (``engine.linear_kernels``) with Triton GEMMs."""

from engine.kernels.linear.int8 import TritonInt8Kernel

__all__ = ["TritonInt8Kernel"]
