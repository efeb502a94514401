"""Quantization: choosing the method at start-up, and the built-in methods and kernels.

The built-ins reach the engine exactly as a plugin's would, as entries of engine-core:
``engine.quantization`` ``gguf`` and ``int8``, ``engine.linear_kernels`` ``gguf_dequant``,
``gguf_int4``, ``int8_int_mm`` and ``int8_reference``. See docs/plugins/quantization.md.
"""

from engine.core.quantization.selection import (
    GGUF_PACKED_BY_DEFAULT,
    QuantizationSelection,
    checkpoint_quantization_config,
    resolve_quantization,
)

__all__ = [
    "GGUF_PACKED_BY_DEFAULT",
    "QuantizationSelection",
    "checkpoint_quantization_config",
    "resolve_quantization",
]
