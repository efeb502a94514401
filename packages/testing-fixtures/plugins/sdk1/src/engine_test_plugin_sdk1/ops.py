"""Custom-op plugin: a replacement for ``rms_norm`` with the reference semantics.

Every allowed ``engine.custom_ops`` entry replaces its op in every model, so this one must
give exactly the reference result; it computes out of place (the inputs are never
modified, which the contract allows either way) and counts its calls. The ``native``
dispatch key keeps the inherited reference, uncounted.
"""

from __future__ import annotations

import torch

from engine.sdk.ops import RMSNormOp
from engine_test_plugin_sdk1.counters import count


class Sdk1RMSNorm(RMSNormOp):
    def _sdk1_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        count("rms_norm.call")
        dtype = x.dtype
        hidden = x.to(torch.float32)
        new_residual = None
        if residual is not None:
            hidden = hidden + residual.to(torch.float32)
            new_residual = hidden.to(dtype)
        variance = hidden.pow(2).mean(dim=-1, keepdim=True)
        y = (hidden * torch.rsqrt(variance + self.eps)).to(dtype) * self.weight
        return y if new_residual is None else (y, new_residual)

    def forward_cpu(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self._sdk1_rms_norm(x, residual)

    def forward_cuda(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self._sdk1_rms_norm(x, residual)

    def forward_oot(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self._sdk1_rms_norm(x, residual)
