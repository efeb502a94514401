"""Torch reference of the ``int8_w8a8`` Triton kernels (same arithmetic, plain torch)."""

from __future__ import annotations

import torch

INT8_MAX = 127


def quantize_per_token_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_q int8 [t, k], x_scale float32 [t])``: symmetric, per row, round half to even."""
    values = x.to(torch.float32, copy=True)
    scale = values.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-12) / INT8_MAX
    q = values.div_(scale).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale.view(-1)


def w8a8_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """``(x_q @ weight^T) * x_scale * weight_scale (+ bias)``, the product in int64."""
    rows = x.reshape(-1, x.shape[-1])
    q, x_scale = quantize_per_token_reference(rows)
    values = (q.long() @ weight.long().t()).float()
    values.mul_(x_scale[:, None]).mul_(weight_scale)
    if bias is not None:
        values += bias
    return values.to(x.dtype).view(*x.shape[:-1], weight.shape[0])
