"""Triton kernels of scheme ``int8_w8a8``: per-token activation quantization and the GEMM.

The arithmetic is engine-core's ``int8_w8a8`` kernels' (``int8_reference``), step by
step, so the result is the same bit for bit wherever float32 rounding is::

    x_scale[t] = max_i |x[t, i]| / 127 (at least 1e-12 / 127)
    x_q[t, i]  = round_half_even(x[t, i] / x_scale[t]) clamped to [-127, 127]   (int8)
    y[t, o]    = float(sum_i x_q[t, i] * weight[o, i]) * x_scale[t] * weight_scale[o]
                 (+ bias[o]), in the activation dtype

The GEMM accumulates in int32 on the tensor cores (``tl.dot`` of int8 tiles) and applies
both scales and the bias in its epilogue: one pass over the weight, which stays in its
checkpoint layout ``[out, in]``.
"""

# Triton reads a kernel's annotations (``tl.constexpr`` marks compile-time arguments), so
# pointer and scalar arguments of ``@triton.jit`` functions stay unannotated.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._jit import next_power_of_2

INT8_MAX = 127


@triton.jit
def _round_half_even(v):
    r = tl.floor(v)
    frac = v - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where((frac > 0.5) | ((frac == 0.5) & odd), r + 1.0, r)


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, scale_ptr, stride_x, stride_q, k, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < k
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / 127.0
    q = tl.minimum(tl.maximum(_round_half_even(x / scale), -127.0), 127.0)
    tl.store(q_ptr + row * stride_q + cols, q.to(tl.int8), mask=mask)
    tl.store(scale_ptr + row, scale)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_q int8 [t, k], x_scale float32 [t])`` of ``x`` ``[t, k]`` (see the module doc)."""
    t, k = x.shape
    q = torch.empty((t, k), dtype=torch.int8, device=x.device)
    scale = torch.empty(t, dtype=torch.float32, device=x.device)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if t:
        _quantize_kernel[(t,)](x, q, scale, x.stride(0), q.stride(0), k,
                               BLOCK=next_power_of_2(k))
    return q, scale


@triton.jit
def _w8a8_gemm_kernel(
    xq_ptr, w_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, m, n, k,
    stride_xq, stride_w, stride_o, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < m
    col_ok = cols < n
    depth = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    a_ptrs = xq_ptr + rows.to(tl.int64)[:, None] * stride_xq + depth[None, :]
    b_ptrs = w_ptr + cols.to(tl.int64)[None, :] * stride_w + depth[:, None]  # weight^T tile
    for start in range(0, k, BLOCK_K):
        k_ok = start + depth < k
        a = tl.load(a_ptrs + start, mask=row_ok[:, None] & k_ok[None, :], other=0)
        b = tl.load(b_ptrs + start, mask=k_ok[:, None] & col_ok[None, :], other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
    x_scale = tl.load(x_scale_ptr + rows, mask=row_ok, other=0.0)
    w_scale = tl.load(w_scale_ptr + cols, mask=col_ok, other=0.0)
    y = acc.to(tl.float32) * x_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_o + cols[None, :],
             y.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def gemm_tiles(m: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K)`` for ``m`` rows: small M tiles for decode batches."""
    block_m = min(128, max(16, next_power_of_2(m)))
    return block_m, 64 if block_m <= 32 else 128, 128


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` with ``W ~= weight * weight_scale[:, None]`` (module doc).

    Args:
        x: ``[..., k]`` activations (bfloat16, float16 or float32).
        weight: ``[n, k]`` int8, rows contiguous.
        weight_scale: ``[n]`` float32.
        bias: ``[n]`` or ``None``.

    Returns:
        ``[..., n]`` in ``x``'s dtype.
    """
    rows = x.reshape(-1, x.shape[-1])
    m, k = rows.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], n)
    q, x_scale = quantize_per_token(rows)
    block_m, block_n, block_k = gemm_tiles(m)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w8a8_gemm_kernel[grid](
        q, weight, x_scale, weight_scale, bias if bias is not None else weight_scale, out,
        m, n, k, q.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out.view(*x.shape[:-1], n)
