"""Triton kernels of the ``triton`` attention backend: the KV write and paged attention.

Both read the KV cache in the backend's layout, one tensor per layer::

    kv_cache [2, num_blocks, block_size, num_kv_heads, head_size]   (keys, then values)
    slot s   = block_id * block_size + offset_in_block

``reshape_and_cache`` writes each row's key and value at its slot (one program per row).

``paged_attention`` is one kernel for prefill, chunked prefill and decode rows of one
step, reading keys and values through the block table (no gather). Work is cut into *query
blocks*: ``BLOCK_Q`` consecutive query tokens of one request, for all ``G = num_heads /
num_kv_heads`` query heads of one KV head, so a program's ``BLOCK_M = BLOCK_Q * G`` rows
share every key and value it loads (grouped-query attention costs no extra KV traffic)::

    grid = (num_tokens // BLOCK_Q + num_reqs, num_kv_heads)     an upper bound on the
                                                                query blocks of any batch
    program (b, h):  request r = the one whose query blocks hold b (binary search over
                     query_start_loc[i] // BLOCK_Q + i); row m is query token
                     b_local * BLOCK_Q + m // G of r, head h * G + m % G
                     for key tiles of TILE keys from the window's start to the causal end:
                         block ids from the block table, keys/values loaded from the cache,
                         s = q k^T * scale, masked (causal, sliding window, context end),
                         online softmax (running max and sum, float32), acc += p v

Programs past the last real query block of the batch return at once. Nothing on the host
depends on the step's values (only ``num_tokens`` and ``num_reqs`` size the grid), so the
launch is the same for any batch of those sizes: what a CUDA graph needs.
"""

# Triton reads a kernel's annotations (``tl.constexpr`` marks compile-time arguments), so
# pointer and scalar arguments of ``@triton.jit`` functions stay unannotated.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._jit import dot_dtype, next_power_of_2
from engine.kernels.attention.batch import PagedBatch

#: Keys per inner-loop tile.
TILE = 32
#: Rows (query tokens x query heads of one KV head) per attention program, at least: for
#: decode-only batches (one query token per request), and for batches with a prefill.
DECODE_BLOCK_M = 16
PREFILL_BLOCK_M = 64
#: Elements (rows x kv heads x head size) one KV-write program copies, at most.
WRITE_ELEMENTS = 4096


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_rows,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_c_block, stride_c_tok, stride_c_head,
    HEAD_SIZE: tl.constexpr, WIDTH: tl.constexpr, WIDTH_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < num_rows
    slot = tl.load(slot_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    cols = tl.arange(0, WIDTH_PAD)                     # (head, dim) of one row, flattened
    head = cols // HEAD_SIZE
    dim = cols % HEAD_SIZE
    mask = row_ok[:, None] & (cols < WIDTH)[None, :]
    cache = ((slot // BLOCK_SIZE) * stride_c_block + (slot % BLOCK_SIZE) * stride_c_tok)[:, None] \
        + (head * stride_c_head + dim)[None, :]
    k = tl.load(key_ptr + rows[:, None] * stride_k_tok + (head * stride_k_head + dim)[None, :],
                mask=mask)
    tl.store(k_cache_ptr + cache, k, mask=mask)
    v = tl.load(value_ptr + rows[:, None] * stride_v_tok + (head * stride_v_head + dim)[None, :],
                mask=mask)
    tl.store(v_cache_ptr + cache, v, mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``key[i]`` and ``value[i]`` at ``slot_mapping[i]`` for every row ``i``.

    Args:
        key: ``[num_tokens, num_kv_heads, head_size]`` (last dimension contiguous).
        value: Like ``key``.
        key_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``, ``key``'s dtype.
        value_cache: Like ``key_cache``, with its strides.
        slot_mapping: ``[num_tokens]`` integer slots (padding rows: null-block slots).
    """
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    _check_inner(key, value, key_cache, value_cache)
    if key_cache.stride() != value_cache.stride():
        raise ValueError("key_cache and value_cache must have the same strides")
    width_pad = next_power_of_2(num_kv_heads * head_size)
    rows = max(1, WRITE_ELEMENTS // width_pad)
    _reshape_and_cache_kernel[(triton.cdiv(num_tokens, rows),)](
        key, value, key_cache, value_cache, slot_mapping, num_tokens,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        HEAD_SIZE=head_size, WIDTH=num_kv_heads * head_size, WIDTH_PAD=width_pad,
        BLOCK_SIZE=key_cache.shape[1], ROWS=rows,
    )


@triton.jit
def _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q: tl.constexpr):
    """The request whose query blocks hold global query block ``q_block`` (binary search)."""
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr,
    query_start_loc_ptr, scale_log2, num_reqs,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_c_block, stride_c_tok, stride_c_head, stride_bt,
    G: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr, WINDOW: tl.constexpr, DOT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    local = q_block - (q_start // BLOCK_Q + req)
    if local * BLOCK_Q >= q_len:
        return  # past the request's last query block (the grid is an upper bound)

    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_PAD)
    q_index = local * BLOCK_Q + rows // G                 # query token within the request
    head = kv_head * G + rows % G
    row_ok = (rows // G < BLOCK_Q) & (q_index < q_len)
    dim_ok = dims < HEAD_SIZE
    q = tl.load(q_ptr + (q_start + q_index)[:, None] * stride_q_tok
                + head[:, None] * stride_q_head + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q = q.to(DOT)

    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len
    position = context_len + q_index                      # each row's absolute position
    last = context_len + tl.minimum((local + 1) * BLOCK_Q, q_len)  # keys [start, last)
    start = 0
    if WINDOW > 0:
        start = tl.maximum(context_len + local * BLOCK_Q - WINDOW + 1, 0)
        start = (start // TILE_N) * TILE_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    for tile in range(start, last, TILE_N):
        keys = tile + tl.arange(0, TILE_N)
        key_ok = keys < last
        block = tl.load(bt_row + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        kv = block * stride_c_block + (keys % BLOCK_SIZE) * stride_c_tok \
            + kv_head * stride_c_head
        k = tl.load(k_cache_ptr + kv[None, :] + dims[:, None],
                    mask=key_ok[None, :] & dim_ok[:, None], other=0.0)
        s = tl.dot(q, k.to(DOT), input_precision=PRECISION) * scale_log2
        visible = key_ok[None, :] & (keys[None, :] <= position[:, None])
        if WINDOW > 0:
            visible = visible & (keys[None, :] > position[:, None] - WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # rows that saw no key yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv[:, None] + dims[None, :],
                    mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v.to(DOT), input_precision=PRECISION)
        m_i = m_new

    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + q_index)[:, None] * stride_o_tok
             + head[:, None] * stride_o_head + dims[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def query_block_size(queries_per_kv_head: int, decode_only: bool) -> tuple[int, int]:
    """``(BLOCK_Q, BLOCK_M)``: query tokens per program, and its rows (tokens x heads)."""
    least = DECODE_BLOCK_M if decode_only else PREFILL_BLOCK_M
    block_m = max(least, next_power_of_2(queries_per_kv_head))
    return block_m // queries_per_kv_head, block_m


def paged_attention(output: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, batch: PagedBatch, *, scale: float,
                    sliding_window: int | None) -> None:
    """Attention of every query row over its request's cached context, into ``output``.

    Args:
        output: ``[num_tokens, num_heads, head_size]`` (rows of each request in
            ``query_start_loc`` order; padding rows past the last request are left alone).
        query: Like ``output``.
        key_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``, already holding
            this step's keys.
        value_cache: Like ``key_cache``, with its strides.
        batch: The step's layout.
        scale: Softmax scale.
        sliding_window: Keys visible to a query: its last ``sliding_window`` (itself
            included); ``None`` for all.
    """
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    if num_tokens == 0 or batch.num_reqs == 0:
        return
    _check_inner(query, output, key_cache, value_cache)
    group = num_heads // num_kv_heads
    block_q, block_m = query_block_size(group, batch.is_decode_only)
    grid = (num_tokens // block_q + batch.num_reqs, num_kv_heads)
    _paged_attention_kernel[grid](
        output, query, key_cache, value_cache, batch.block_table, batch.seq_lens,
        batch.query_start_loc, scale * 1.4426950408889634, batch.num_reqs,  # log2(e): exp2
        query.stride(0), query.stride(1), output.stride(0), output.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        batch.block_table.stride(0),
        G=group, HEAD_SIZE=head_size, HEAD_PAD=max(16, next_power_of_2(head_size)),
        BLOCK_SIZE=key_cache.shape[1], TILE_N=TILE, BLOCK_Q=block_q, BLOCK_M=block_m,
        WINDOW=sliding_window or 0, DOT=dot_dtype(query.dtype),
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )


def _check_inner(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(f"the last dimension must be contiguous, got strides {t.stride()}")
