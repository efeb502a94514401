"""``engine.custom_ops`` entry ``rms_norm``: RMSNorm as one ``torch.library`` op on the CPU.

Registered under the op's name, beside the engine's own implementations (the built-in C++
one and engine-kernels' Triton one): on the CPU it has a path of its own, so by the default
rule it is used there (a third party's at equal priority); on other devices it runs the
contract's reference. ``--custom-ops -rms_norm`` (or ``+rms_norm=engine-core``) turns it off.
"""

from __future__ import annotations

import torch

from acme_engine_plugins.general import define_ops
from engine.sdk.ops import RMSNormOp

define_ops()


class AcmeRMSNorm(RMSNormOp):
    """``rms_norm`` with the residual add fused: ``acme::add_rms_norm`` on the CPU."""

    def forward_cpu(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            out: torch.Tensor = torch.ops.acme.rms_norm(x, self.weight, self.eps)
            return out
        y, new_residual = torch.ops.acme.add_rms_norm(x, residual, self.weight, self.eps)
        return y, new_residual
