"""Where engine-kernels' tests run their kernels: a CUDA device, or Triton's interpreter.

Without a GPU, ``TRITON_INTERPRET=1`` is set here, before any kernel module is imported
(``@triton.jit`` reads it when a kernel is defined), and every kernel runs on CPU tensors
through the interpreter. With a GPU the same tests run compiled on it. Tests marked
``gpu`` need a real device and are skipped without one, saying so.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

#: The device the kernel tests put their tensors on.
DEVICE = "cuda" if HAS_CUDA else "cpu"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False); "
                                   "the kernels are checked here under TRITON_INTERPRET=1")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    """``"cuda"`` with a GPU, else ``"cpu"`` (the interpreter)."""
    return DEVICE
