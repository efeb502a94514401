"""``engine.platforms`` entry ``acme_cpu``: the host CPU with this package's defaults.

Installed, it claims nothing: :func:`detect` returns ``None`` unless ``ACME_ENGINE_PLATFORM``
is ``1``, so it never takes a host from the engine's own ``cpu`` platform by surprise. When
enabled, the engine runs on the CPU with attention by this package's ``acme_sdpa`` backend,
KV blocks of a multiple of 32 tokens (``--block-size`` rounded up) and float32 for
``--dtype auto``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from engine.sdk import Platform, PlatformConfig, Support

if TYPE_CHECKING:
    from engine.sdk.attention import AttentionSpec

#: Set to ``1`` (in every process of the engine) to let ``acme_cpu`` claim the host.
ENV_VAR = "ACME_ENGINE_PLATFORM"

#: Block sizes are rounded up to a multiple of this.
BLOCK_MULTIPLE = 32


class AcmeCPUPlatform(Platform):
    """The host's CPU, named ``acme_cpu``."""

    name = "acme_cpu"
    device_type = "cpu"
    dist_backend = "gloo"

    @classmethod
    def is_available(cls) -> Support:
        if os.environ.get(ENV_VAR) != "1":
            return Support.no(f"set {ENV_VAR}=1 to run on acme_cpu")
        return Support.yes()

    @classmethod
    def device_count(cls) -> int:
        return 1

    @classmethod
    def get_device_name(cls, index: int = 0) -> str:
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
        except OSError:
            pass
        return "CPU"

    @classmethod
    def get_device_total_memory(cls, index: int = 0) -> int:
        try:
            return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        except (ValueError, OSError, AttributeError):
            return 0

    @classmethod
    def supported_dtypes(cls) -> tuple[str, ...]:
        return ("float32", "bfloat16")

    @classmethod
    def default_attention_backend(cls, spec: AttentionSpec) -> str:
        return "acme_sdpa"

    @classmethod
    def check_and_update_config(cls, config: PlatformConfig) -> None:
        if config.dtype in (None, "auto"):
            config.dtype = "float32"
        size = config.block_size or BLOCK_MULTIPLE
        config.block_size = -(-size // BLOCK_MULTIPLE) * BLOCK_MULTIPLE


def detect() -> type[Platform] | None:
    """engine.platforms entry: claim the host only when ``ACME_ENGINE_PLATFORM=1``."""
    return AcmeCPUPlatform if AcmeCPUPlatform.is_available().ok else None
