"""The engine's CPU kernels in C++, built on first use (see ``library``).

Used by the ``cpu`` attention backend, the built-in ops' CPU paths, the ``cpu`` linear
kernel and the GGUF kernels' dequantization.
"""

from engine.core.native.library import (
    NativeKernels,
    NativeKernelsUnavailable,
    load,
    native_kernels,
)

__all__ = ["NativeKernels", "NativeKernelsUnavailable", "load", "native_kernels"]
