"""GGUF weights for tests: stored blocks of any type, and a linear kernel holding them."""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from engine.kernels.gguf.formats import FORMATS
from engine.sdk.linear_kernel import LinearKernelConfig

GEN = np.random.default_rng(0)


def raw_blocks(name: str, rows: int, cols: int) -> np.ndarray:
    """Stored bytes ``[rows, row_bytes]`` of type ``name``.

    Random normal values quantized with ``gguf`` where it can, else random blocks with
    finite float16 scales.
    """
    qtype = QT[name]
    values = GEN.standard_normal((rows, cols)).astype(np.float32)
    if name in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        data = gguf.quants.quantize(values, qtype) if name != "F16" else values.astype(
            np.float16)
        return np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1)
    fmt = FORMATS[name]
    blocks = GEN.integers(0, 256, (rows * cols // fmt.block_size, fmt.type_size), np.uint8)
    scales = (GEN.random((blocks.shape[0], 2)) * 0.01).astype(np.float16).view(np.uint8)
    if name == "Q6_K":
        blocks[:, 208:210] = scales[:, :2]  # d
    else:
        blocks[:, 0:4] = scales  # d, dmin
    return blocks.reshape(rows, -1)


def kernel_layer(kernel_cls: type, name: str, rows: int, cols: int, dtype: str
                 ) -> tuple[Any, torch.nn.Module, torch.Tensor]:
    """A kernel, a layer holding GGUF rows, and the dequantized float32 weight."""
    data = torch.from_numpy(raw_blocks(name, rows, cols))
    fmt = FORMATS[name]
    config = LinearKernelConfig(scheme="gguf", weight_dtype=name, act_dtype=dtype,
                                input_size=cols, output_size=rows, group_size=fmt.block_size,
                                zero_point=fmt.zero_point)
    assert kernel_cls.can_implement(config).ok
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(data, requires_grad=False)
    kernel = kernel_cls(config)
    kernel.process_weights_after_loading(layer)
    return kernel, layer, fmt.dequantize(data, torch.empty(rows, cols))
