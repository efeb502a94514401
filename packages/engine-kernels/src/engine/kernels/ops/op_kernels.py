"""Triton kernels of the custom-op replacements: RMSNorm, RoPE, SiLU- and GELU-and-mul.

RMSNorm optionally with the residual add fused; GELU in its erf or tanh form.

Each computes exactly what its SDK contract's ``forward_native`` does (``engine.sdk.ops``),
in the same order and precision: float32 math, a rounding to the activation dtype where
the reference rounds. Rows (tokens) may be strided; the last dimension must be contiguous.
"""

# Triton reads a kernel's annotations (``tl.constexpr`` marks compile-time arguments), so
# pointer and scalar arguments of ``@triton.jit`` functions stay unannotated.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._jit import next_power_of_2

#: Elements of one row one SiLU-and-mul (or GELU-and-mul) program handles.
SILU_BLOCK = 1024
#: ``F.gelu``'s constants: 1/sqrt(2) (erf form); sqrt(2/pi) and 0.044715 (tanh form).
#: Compile-time constants: a kernel reads no other globals.
GELU_SQRT_HALF = tl.constexpr(0.7071067811865476)
GELU_TANH_BETA = tl.constexpr(0.7978845608028654)
GELU_TANH_KAPPA = tl.constexpr(0.044715)


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_r, stride_o,
                     hidden, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r_ptrs = residual_ptr + row * stride_r + cols
        h = h + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(r_ptrs, h.to(residual_ptr.dtype.element_ty), mask=mask)  # new residual
    mean_square = tl.sum(h * h, axis=0) / hidden
    normed = (h * tl.math.rsqrt(mean_square + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """``RMSNormOp`` semantics; with ``residual``, it is overwritten with the new residual.

    Returns the normalised rows in ``promote(x.dtype, weight.dtype)`` (a new tensor).
    """
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden)
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype),
                      device=x.device)
    res = rows if residual is None else residual.view(-1, hidden)
    _check_rows(rows, res)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, res, weight, out, rows.stride(0), res.stride(0), out.stride(0), hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=next_power_of_2(hidden))
    return out.view(x.shape)


@triton.jit
def _rotary_kernel(positions_ptr, x_ptr, cache_ptr, stride_tok, stride_head, stride_cache,
                   num_heads, ROT_HALF: tl.constexpr, HEADS_PAD: tl.constexpr,
                   PAIRS_PAD: tl.constexpr, IS_NEOX: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    pairs = tl.arange(0, PAIRS_PAD)
    heads = tl.arange(0, HEADS_PAD)
    pair_ok = pairs < ROT_HALF
    cos = tl.load(cache_ptr + position * stride_cache + pairs, mask=pair_ok, other=0.0)
    sin = tl.load(cache_ptr + position * stride_cache + ROT_HALF + pairs, mask=pair_ok,
                  other=0.0)
    cos = cos.to(tl.float32)[None, :]
    sin = sin.to(tl.float32)[None, :]
    if IS_NEOX:   # rotate halves: (x[i], x[i + r/2])
        first = pairs
        second = pairs + ROT_HALF
    else:         # rotate pairs: (x[2i], x[2i + 1])
        first = 2 * pairs
        second = 2 * pairs + 1
    base = x_ptr + token * stride_tok + heads[:, None] * stride_head
    mask = (heads < num_heads)[:, None] & pair_ok[None, :]
    x1 = tl.load(base + first[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + second[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(base + first[None, :], (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + second[None, :], (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty),
             mask=mask)


def rotary_embedding(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor,
                     rotary_dim: int, is_neox_style: bool) -> torch.Tensor:
    """Rotate ``x`` ``[num_tokens, num_heads, head_size]`` in place (``RotaryEmbeddingOp``)."""
    num_tokens, num_heads, _ = x.shape
    _check_rows(x, cos_sin_cache)
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            positions, x, cos_sin_cache, x.stride(0), x.stride(1), cos_sin_cache.stride(0),
            num_heads, ROT_HALF=rotary_dim // 2, HEADS_PAD=next_power_of_2(num_heads),
            PAIRS_PAD=next_power_of_2(rotary_dim // 2), IS_NEOX=is_neox_style)
    return x


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty)  # rounded, as F.silu
    y = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``SiluAndMulOp`` semantics: ``silu(x[..., :d]) * x[..., d:]`` (a new tensor)."""
    d = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * d)
    out = torch.empty(rows.shape[0], d, dtype=x.dtype, device=x.device)
    _check_rows(rows)
    if rows.shape[0] and d:
        block = min(SILU_BLOCK, next_power_of_2(d))
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(d, block))](
            rows, out, rows.stride(0), out.stride(0), d, BLOCK=block)
    return out.view(*x.shape[:-1], d)


@triton.jit
def _gelu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, d, TANH: tl.constexpr,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    if TANH:  # tl.math has no tanh: 1 + tanh(v) from t = exp(-2|v|) (no overflow), as
        # 2 / (1 + t) for v >= 0 and 2 t / (1 + t) below (no cancellation)
        inner = GELU_TANH_BETA * (gate + GELU_TANH_KAPPA * (gate * gate * gate))
        t = tl.exp(-2.0 * tl.abs(inner))
        one_plus_tanh = tl.where(inner >= 0, 2.0, 2.0 * t) / (1.0 + t)
        gelu = 0.5 * gate * one_plus_tanh
    else:
        gelu = gate * 0.5 * (1.0 + tl.math.erf(gate * GELU_SQRT_HALF))
    y = gelu.to(x_ptr.dtype.element_ty).to(tl.float32) * up.to(tl.float32)  # rounded, as F.gelu
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def gelu_and_mul(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """``GeluAndMulOp`` semantics: ``gelu(x[..., :d], approximate) * x[..., d:]`` (a new tensor).

    ``approximate``: ``"none"`` (erf) or ``"tanh"``, as ``F.gelu`` takes it.
    """
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu_and_mul: approximate={approximate!r} is not supported; "
                         f"allowed: 'none', 'tanh'")
    d = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * d)
    out = torch.empty(rows.shape[0], d, dtype=x.dtype, device=x.device)
    _check_rows(rows)
    if rows.shape[0] and d:
        block = min(SILU_BLOCK, next_power_of_2(d))
        _gelu_and_mul_kernel[(rows.shape[0], triton.cdiv(d, block))](
            rows, out, rows.stride(0), out.stride(0), d, TANH=approximate == "tanh",
            BLOCK=block)
    return out.view(*x.shape[:-1], d)


def _check_rows(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(f"the last dimension must be contiguous, got strides {t.stride()}")
