"""The engine's CPU kernels in C++ (``library``) and the CPU step graph's runtime (``runtime``).

Both are built on first use (``build``), each a library of its own.

The kernels are used by the ``cpu`` attention backend, the built-in ops' CPU paths, the
``cpu`` linear kernel and the GGUF kernels' dequantization; the runtime by the step graph,
which calls any kernel's step-graph entry by address (``engine.sdk.graph_calls``).
"""

from engine.core.native.library import (
    NativeKernels,
    NativeKernelsUnavailable,
    load,
    native_kernels,
)

__all__ = ["NativeKernels", "NativeKernelsUnavailable", "load", "native_kernels"]
