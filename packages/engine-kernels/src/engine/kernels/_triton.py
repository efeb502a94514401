"""Whether Triton can run here, answered without importing it (capability hooks use this).

Two ways a kernel of this package runs:

* on a CUDA device, compiled by Triton (the production path);
* on CPU tensors through Triton's interpreter, when ``TRITON_INTERPRET=1`` was set before
  the kernel modules were imported (``@triton.jit`` reads it when a kernel is defined).
  That is how this package's tests check every kernel on a machine without a GPU; it is
  far too slow to serve with.

The kernel modules (``*_kernels.py``) import triton at their top; everything else in the
package imports them lazily, so a CPU install without triton can still list, check and
reject this package's plugins with a reason.
"""

from __future__ import annotations

import importlib.util
import os

#: What to install to get triton (``engine-server[cuda]`` depends on it).
INSTALL_HINT = "pip install 'engine-server[cuda]', or pip install triton"

_TRUE = ("1", "true", "on", "yes")


def triton_installed() -> bool:
    """True when ``import triton`` would find a package (nothing is imported)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET`` is set the way Triton reads it (``1``, ``true``, ...)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


def device_problem(device_type: str) -> str | None:
    """Why this package's kernels cannot run on ``device_type`` now, or ``None`` if they can.

    CUDA needs triton installed; the CPU needs triton and the interpreter (tests only).
    """
    if not triton_installed():
        return f"triton is not installed ({INSTALL_HINT})"
    if device_type == "cuda":
        return None
    if device_type == "cpu" and interpreting():
        return None
    return (f"its Triton kernels run on CUDA devices, not {device_type} (on the CPU only "
            f"through Triton's interpreter, TRITON_INTERPRET=1, for tests)")
