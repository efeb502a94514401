"""The built-in CUDA platform: NVIDIA GPUs through ``torch.cuda``, NCCL between ranks.

Selected when the ``cuda`` detector finds a GPU torch can use (``torch.cuda.is_available()``
is False on a CPU build of torch and on a machine without a driver or device, so this
platform never claims a CPU-only host). Device queries go through torch; on a host
without a usable GPU they raise ``RuntimeError`` saying so, never torch's
``AssertionError``.

Default attention backend: ``triton`` (engine-kernels, found like any plugin through
``engine.attention_backends``) when it is installed, allowed, and its ``supports`` accepts
the layers (on this device); otherwise the built-in ``torch`` backend, with one log line
saying why. Graphs: the worker captures decode steps as CUDA graphs
(``engine.core.worker.cuda_graphs``) unless ``--enforce-eager``; this platform leaves
``enforce_eager`` as the operator set it.
"""

from __future__ import annotations

import logging
from typing import ClassVar

import torch

from engine.sdk.attention import AttentionSpec, backend_supports
from engine.sdk.groups import ATTENTION_BACKENDS
from engine.sdk.platform import Platform
from engine.sdk.support import Support

logger = logging.getLogger("engine.worker")

#: The attention backend preferred on CUDA (engine-kernels' entry) and the fallback.
PREFERRED_BACKEND = "triton"
FALLBACK_BACKEND = "torch"


def _require_gpu(index: int) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(f"no CUDA device: {CudaPlatform.is_available().reason}")
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise RuntimeError(f"CUDA device {index} does not exist; this host has {count} "
                           f"(indices 0 to {count - 1})")


class CudaPlatform(Platform):
    """NVIDIA GPUs through torch.cuda; NCCL between ranks; Triton attention by default."""

    name: ClassVar[str] = "cuda"
    device_type: ClassVar[str] = "cuda"
    dist_backend: ClassVar[str] = "nccl"

    @classmethod
    def is_available(cls) -> Support:
        if not torch.backends.cuda.is_built():  # type: ignore[no-untyped-call]
            return Support.no(f"this torch ({torch.__version__}) is a CPU build: install a "
                              f"CUDA build of torch")
        if not torch.cuda.is_available():
            return Support.no("torch.cuda.is_available() is False: no NVIDIA GPU or driver "
                              "is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)")
        return Support.yes()

    @classmethod
    def device_count(cls) -> int:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    @classmethod
    def get_device_name(cls, index: int = 0) -> str:
        _require_gpu(index)
        return str(torch.cuda.get_device_name(index))

    @classmethod
    def get_device_capability(cls, index: int = 0) -> tuple[int, int] | None:
        _require_gpu(index)
        major, minor = torch.cuda.get_device_capability(index)
        return (major, minor)

    @classmethod
    def get_device_total_memory(cls, index: int = 0) -> int:
        _require_gpu(index)
        return int(torch.cuda.get_device_properties(index).total_memory)

    @classmethod
    def get_device_free_memory(cls, index: int = 0) -> int:
        """Bytes free on device ``index`` now (the driver's view, other processes included)."""
        _require_gpu(index)
        free, _ = torch.cuda.mem_get_info(index)
        return int(free)

    @classmethod
    def supported_dtypes(cls) -> tuple[str, ...]:
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return ("bfloat16", "float16", "float32")
        return ("float16", "float32")

    @classmethod
    def default_attention_backend(cls, spec: AttentionSpec) -> str:
        from engine.core.plugins import get_catalog

        catalog = get_catalog()
        if PREFERRED_BACKEND not in catalog.names(ATTENTION_BACKENDS):
            logger.info("attention: %r is not installed or not allowed (engine-kernels "
                        "provides it); using %r", PREFERRED_BACKEND, FALLBACK_BACKEND)
            return FALLBACK_BACKEND
        backend = catalog.load(ATTENTION_BACKENDS, PREFERRED_BACKEND)
        # as given: asking the device would start CUDA here
        answer = backend_supports(backend, spec)
        if not answer.ok:
            logger.info("attention: %r cannot serve %s (%s); using %r", PREFERRED_BACKEND,
                        spec.describe(), answer.reason, FALLBACK_BACKEND)
            return FALLBACK_BACKEND
        return PREFERRED_BACKEND


def detect_cuda() -> type[Platform] | None:
    """Entry point: CUDA when torch sees a GPU."""
    return CudaPlatform if torch.cuda.is_available() else None
