"""``engine.general_plugins`` entry: define the package's torch ops in every process.

``acme::rms_norm`` and ``acme::add_rms_norm`` are ``torch.library`` custom ops (one
dispatcher call each, opaque to graph capture) that :mod:`acme_engine_plugins.ops` runs. A
general plugin is the documented place for ``torch.library`` registrations: the engine
calls :func:`register` in the front end, EngineCore and every worker before it builds a
model. Importing :mod:`acme_engine_plugins.ops` defines them too (for tests and notebooks
that build the op directly); defining them twice is harmless.
"""

from __future__ import annotations

import threading

import torch

_lock = threading.Lock()
_defined = False


def _normalize(h: torch.Tensor, weight: torch.Tensor, eps: float,
               dtype: torch.dtype) -> torch.Tensor:
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(dtype) * weight


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _normalize(x.float(), weight, eps, x.dtype)


def _add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    h = x.float() + residual.float()  # a new tensor: the outputs alias no input
    return _normalize(h, weight, eps, x.dtype), h.to(x.dtype)


def define_ops() -> None:
    """Define ``acme::rms_norm`` and ``acme::add_rms_norm`` here, unless already defined."""
    global _defined
    with _lock:
        if _defined:
            return
        rms_norm = torch.library.custom_op("acme::rms_norm", _rms_norm, mutates_args=())
        rms_norm.register_fake(lambda x, weight, eps: torch.empty_like(x))
        add_rms_norm = torch.library.custom_op("acme::add_rms_norm", _add_rms_norm,
                                               mutates_args=())
        add_rms_norm.register_fake(
            lambda x, residual, weight, eps: (torch.empty_like(x), torch.empty_like(x)))
        _defined = True


def register() -> None:
    """engine.general_plugins entry: define the ops; idempotent, cheap and quiet."""
    define_ops()
