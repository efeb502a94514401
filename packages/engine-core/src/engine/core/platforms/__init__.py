"""Built-in platforms (CPU, CUDA) and the selection of the current one."""

from engine.core.platforms._builtin import CpuPlatform, CudaPlatform, detect_cpu, detect_cuda
from engine.core.platforms._select import current_platform, select_platform

__all__ = [
    "CpuPlatform",
    "CudaPlatform",
    "current_platform",
    "detect_cpu",
    "detect_cuda",
    "select_platform",
]
