"""The engine's CPU kernels in C++ (``library``), built on first use by ``engine.sdk.native``.

They serve the ``cpu`` attention backend, the CPU custom ops, the ``cpu`` linear kernel
and the GGUF kernels' dequantization; each recordable kernel has a step-graph entry that
engine-core's CPU step graph calls by address (``engine.sdk.graph_calls``).
"""

from engine.kernels.cpu.native.library import (
    NativeBuildError,
    NativeKernels,
    load,
    native_kernels,
)

__all__ = ["NativeBuildError", "NativeKernels", "load", "native_kernels"]
