"""The CPU attention kernels in C++ (see ``library``), used by the ``cpu`` backend."""

from engine.core.attention.native.library import NativeKernels, NativeKernelsUnavailable, load

__all__ = ["NativeKernels", "NativeKernelsUnavailable", "load"]
