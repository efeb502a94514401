"""Facts about this machine that cached results depend on: the cache directory, the CPU.

Whatever the engine builds or measures once and reuses (the native libraries compiled by
``engine.sdk.native``, the kernel choices it measures) lives under :func:`cache_dir`, keyed
by :func:`cpu_model` and :func:`cpu_flags` among others (and :func:`target_arch`, the
``-march`` native code is built for), so a copy of the directory on another CPU is not
reused. The SDK defines them, so a plugin's caches key on the same facts.
"""

from __future__ import annotations

from engine.sdk.native import cache_dir, cpu_flags, cpu_model, target_arch

__all__ = ["cache_dir", "cpu_flags", "cpu_model", "target_arch"]
