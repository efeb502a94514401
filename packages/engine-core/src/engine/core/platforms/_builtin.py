"""The built-in platforms: CPU (always available) and CUDA (``cuda.py``, when torch sees a GPU)."""

from __future__ import annotations

import functools
import logging
import os
import platform as host
from typing import ClassVar

from engine.core.machine import cpu_flags
from engine.core.platforms.cuda import CudaPlatform, detect_cuda
from engine.sdk.attention import AttentionSpec
from engine.sdk.platform import Platform, PlatformConfig
from engine.sdk.support import Support

logger = logging.getLogger(__name__)

#: The attention backend the CPU platform prefers (engine-kernels'), by its entry name.
PREFERRED_BACKEND = "cpu"
#: The CPU platform's token budget where the operator gives none (``--max-num-batched-tokens``).
CPU_TOKEN_BUDGET = 512


def cpu_supports_bf16() -> bool:
    """True when the CPU has native bfloat16 instructions (avx512_bf16 or AMX)."""
    return not {"avx512_bf16", "amx_bf16"}.isdisjoint(cpu_flags().split())


class CpuPlatform(Platform):
    """Host CPU: torch's CPU kernels, gloo between ranks, the ``cpu`` attention backend."""

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
    def check_and_update_config(cls, config: PlatformConfig) -> None:
        """A token budget of ``CPU_TOKEN_BUDGET`` where the operator gave none.

        On a CPU a step of 2048 prompt tokens takes about a second (the matrix products
        run at their peak from ~64 rows on), and every running stream waits for it: steps
        of 512 give the first tokens of a burst of prompts sooner (mean TTFT 27-33% lower
        at 64 concurrent streams) and keep the decode interval short, at a
        throughput equal within the noise (benchmarks/README.md).
        """
        if config.max_num_batched_tokens is None:
            config.max_num_batched_tokens = CPU_TOKEN_BUDGET

    @classmethod
    def default_attention_backend(cls, spec: AttentionSpec) -> str:
        """``cpu`` (engine-kernels' C++ paged kernels) where it can serve ``spec``, else ``torch``.

        ``cpu`` is looked up by name in the plugin catalog, as ``--attention-backend cpu``
        would be; not installed, not allowed, failing to import or refusing ``spec``, the
        reason is logged once and engine-core's ``torch`` backend serves.
        """
        from engine.core.plugins import get_catalog
        from engine.sdk.attention import backend_supports
        from engine.sdk.errors import PluginError
        from engine.sdk.groups import ATTENTION_BACKENDS

        try:
            support = backend_supports(get_catalog().load(ATTENTION_BACKENDS, PREFERRED_BACKEND),
                                       spec)
        except PluginError as exc:
            support = Support.no(str(exc))
        if support:
            return PREFERRED_BACKEND
        _warn_fallback(support.reason)
        return "torch"


@functools.cache
def _warn_fallback(reason: str) -> None:
    logger.warning("attention: the cpu backend cannot serve this model (%s); using the "
                   "torch backend (slower decode: SDPA over gathered blocks)", reason)


def detect_cpu() -> type[Platform]:
    """Entry point: the CPU is always there."""
    return CpuPlatform


__all__ = ["CpuPlatform", "CudaPlatform", "cpu_supports_bf16", "detect_cpu", "detect_cuda"]
