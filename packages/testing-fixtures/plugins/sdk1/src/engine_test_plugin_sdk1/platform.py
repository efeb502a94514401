"""Platform plugin: a CPU platform that claims the host only when asked to.

Harmless when installed: :func:`detect` returns None unless ``ENGINE_TEST_SDK1_PLATFORM=1``.
When it claims the host, its effects are observable: attention defaults to this
distribution's ``sdk1_paged`` backend, the block size is rounded up to a multiple of 32,
and ``dtype="auto"`` becomes float32.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, ClassVar

from engine.sdk import Platform, PlatformConfig, Support
from engine_test_plugin_sdk1.counters import count

if TYPE_CHECKING:
    from engine.sdk import AttentionSpec

#: Set to ``1`` to let this platform claim the host.
ENV_VAR = "ENGINE_TEST_SDK1_PLATFORM"

#: Block sizes this platform accepts are multiples of this.
BLOCK_MULTIPLE = 32


def _enabled() -> bool:
    return os.environ.get(ENV_VAR) == "1"


class Sdk1CpuPlatform(Platform):
    """The host CPU under another name, with its own defaults."""

    name: ClassVar[str] = "sdk1_cpu"
    device_type: ClassVar[str] = "cpu"
    dist_backend: ClassVar[str] = "gloo"

    @classmethod
    def is_available(cls) -> Support:
        count("sdk1_cpu.is_available")
        if not _enabled():
            return Support.no(f"set {ENV_VAR}=1 to use the sdk1_cpu test platform")
        return Support.yes()

    @classmethod
    def device_count(cls) -> int:
        return 1

    @classmethod
    def get_device_name(cls, index: int = 0) -> str:
        return f"sdk1 test CPU #{index}"

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
        count("sdk1_cpu.default_attention_backend")
        return "sdk1_paged"

    @classmethod
    def check_and_update_config(cls, config: PlatformConfig) -> None:
        count("sdk1_cpu.check_and_update_config")
        if config.dtype in (None, "auto"):
            config.dtype = "float32"
        if config.block_size is None or config.block_size % BLOCK_MULTIPLE:
            size = config.block_size or BLOCK_MULTIPLE
            config.block_size = -(-size // BLOCK_MULTIPLE) * BLOCK_MULTIPLE
        config.enforce_eager = True


def detect() -> type[Platform] | None:
    """engine.platforms entry: claim the host only when ENGINE_TEST_SDK1_PLATFORM=1."""
    count("sdk1_cpu.detect")
    return Sdk1CpuPlatform if _enabled() else None
