"""Facts about this machine that cached results depend on: the cache directory, the CPU.

Whatever the engine builds or measures once and reuses (the CPU kernels it compiles, the
kernel choices it measures) lives under :func:`cache_dir`, keyed by :func:`cpu_model` and
:func:`cpu_flags` among others, so a copy of the directory on another CPU is not reused.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$ENGINE_CACHE_DIR``, else ``$XDG_CACHE_HOME/engine`` or ``~/.cache/engine``."""
    root = os.environ.get("ENGINE_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "engine"


def _cpuinfo_field(name: str) -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":", 1)[0].strip() == name:
                return line.split(":", 1)[1].strip() if ":" in line else ""
    except OSError:
        pass
    return ""


def cpu_flags() -> str:
    """The first CPU's feature flags (``/proc/cpuinfo``), space-separated; "" if unknown."""
    return _cpuinfo_field("flags")


def cpu_model() -> str:
    """The first CPU's model name (``/proc/cpuinfo``); "" if unknown."""
    return _cpuinfo_field("model name")
