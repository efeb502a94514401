"""The engine's CPU kernels in C++, built on first use (see ``library``).

Used by the ``cpu`` attention backend.
"""

from engine.core.native.library import NativeKernels, NativeKernelsUnavailable, load

__all__ = ["NativeKernels", "NativeKernelsUnavailable", "load"]
