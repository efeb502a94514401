"""One reused buffer per thread, dtype and device, for weights dequantized on the fly.

Kernels that dequantize a layer's weight for each matmul write it here instead of
allocating: the buffer grows to the largest request and is then reused by every layer.
A view is valid until the next :func:`scratch` call on the same thread.

The buffer is a normal tensor even when first asked for under ``torch.inference_mode``
(as the engine's steps run): an inference tensor could not be written outside that mode
later (a kernel called directly, a test), and a normal one serves both.
"""

from __future__ import annotations

import threading

import torch

_local = threading.local()


def scratch(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D view of ``numel`` elements of this thread's buffer for ``(dtype, device)``."""
    buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = _local.__dict__.setdefault(
        "buffers", {})
    key = (dtype, torch.device(device))
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        with torch.inference_mode(False):
            buffer = buffers[key] = torch.empty(numel, dtype=dtype, device=device)
    return buffer[:numel]
