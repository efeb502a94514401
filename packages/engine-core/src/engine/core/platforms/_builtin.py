"""The built-in platforms: CPU (always available) and CUDA (when torch sees a GPU)."""

from __future__ import annotations

import os
import platform as host
from typing import ClassVar

import torch

from engine.sdk.attention import AttentionSpec
from engine.sdk.platform import Platform
from engine.sdk.support import Support


def cpu_supports_bf16() -> bool:
    """True when the CPU has native bfloat16 instructions (avx512_bf16 or AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


class CpuPlatform(Platform):
    """Host CPU: torch's CPU kernels, gloo between ranks, the torch attention backend."""

    name: ClassVar[str] = "cpu"
    device_type: ClassVar[str] = "cpu"
    dist_backend: ClassVar[str] = "gloo"

    @classmethod
    def is_available(cls) -> Support:
        return Support.yes()

    @classmethod
    def device_count(cls) -> int:
        return 1

    @classmethod
    def get_device_name(cls, index: int = 0) -> str:
        return host.processor() or host.machine() or "cpu"

    @classmethod
    def get_device_total_memory(cls, index: int = 0) -> int:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    @classmethod
    def supported_dtypes(cls) -> tuple[str, ...]:
        return ("bfloat16", "float32") if cpu_supports_bf16() else ("float32", "bfloat16")

    @classmethod
    def default_attention_backend(cls, spec: AttentionSpec) -> str:
        return "torch"


class CudaPlatform(Platform):
    """NVIDIA GPUs through torch.cuda; NCCL between ranks."""

    name: ClassVar[str] = "cuda"
    device_type: ClassVar[str] = "cuda"
    dist_backend: ClassVar[str] = "nccl"

    @classmethod
    def is_available(cls) -> Support:
        if torch.cuda.is_available():
            return Support.yes()
        return Support.no("torch.cuda.is_available() is False (no GPU, or a CPU build of torch)")

    @classmethod
    def device_count(cls) -> int:
        return torch.cuda.device_count()

    @classmethod
    def get_device_name(cls, index: int = 0) -> str:
        return torch.cuda.get_device_name(index)

    @classmethod
    def get_device_capability(cls, index: int = 0) -> tuple[int, int] | None:
        major, minor = torch.cuda.get_device_capability(index)
        return (major, minor)

    @classmethod
    def get_device_total_memory(cls, index: int = 0) -> int:
        return int(torch.cuda.get_device_properties(index).total_memory)

    @classmethod
    def supported_dtypes(cls) -> tuple[str, ...]:
        return ("bfloat16", "float16", "float32")

    @classmethod
    def default_attention_backend(cls, spec: AttentionSpec) -> str:
        return "torch"


def detect_cpu() -> type[Platform]:
    """Entry point: the CPU is always there."""
    return CpuPlatform


def detect_cuda() -> type[Platform] | None:
    """Entry point: CUDA when torch sees a GPU."""
    return CudaPlatform if torch.cuda.is_available() else None
