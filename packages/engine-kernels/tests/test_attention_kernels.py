"""The paged-attention kernels against their torch references (``attention/reference.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.kernels.attention import paged_kernels
from engine.kernels.attention.batch import PagedBatch
from engine.kernels.attention.paged_kernels import paged_attention, reshape_and_cache
from engine.kernels.attention.reference import (
    paged_attention_reference,
    reshape_and_cache_reference,
)

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def make_batch(query_lens: list[int], seq_lens: list[int], block_size: int, num_blocks: int,
               device: str, seed: int = 0, width: int | None = None) -> PagedBatch:
    """Requests with shuffled, distinct blocks (never block 0) and zero-padded tables."""
    generator = torch.Generator().manual_seed(seed)
    width = width or max(-(-s // block_size) for s in seq_lens) + 1
    ids = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    slots = []
    for i, (q_len, s_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        blocks = [ids.pop() for _ in range(-(-s_len // block_size))]
        table[i, : len(blocks)] = torch.tensor(blocks)
        slots += [blocks[p // block_size] * block_size + p % block_size
                  for p in range(s_len - q_len, s_len)]
    starts = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    return PagedBatch(
        query_start_loc=starts.to(device), seq_lens=torch.tensor(seq_lens, dtype=torch.int32,
                                                                 device=device),
        block_table=table.to(device), slot_mapping=torch.tensor(slots, device=device),
        num_reqs=len(seq_lens), num_actual_tokens=sum(query_lens),
        max_query_len=max(query_lens))


def random_cache(num_blocks: int, block_size: int, kv_heads: int, head_size: int,
                 dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.randn(2, num_blocks, block_size, kv_heads, head_size).to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reshape_and_cache_writes_every_row_at_its_slot(dtype: torch.dtype, device: str) -> None:
    cache = torch.zeros(2, 9, 12, 3, 80, dtype=dtype, device=device)  # block size 12, D 80
    expected = cache.clone()
    slots = torch.tensor([5, 12, 13, 47, 107, 0, 1], device=device)  # last two: padding
    # Rows of a fused tensor: strided in dim 0, as a model's qkv split gives them.
    fused = torch.randn(7, 2 * 3 * 80 + 8).to(dtype).to(device)
    key = fused[:, :240].view(7, 3, 80)
    value = fused[:, 240:480].view(7, 3, 80)
    reshape_and_cache(key, value, cache[0], cache[1], slots)
    reshape_and_cache_reference(key, value, expected[0], expected[1], slots)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_size", "block_size", "window"), [
    (2, 2, 64, 16, None),
    (6, 2, 128, 16, None),
    (8, 2, 64, 32, 37),
    (4, 1, 128, 12, 7),     # a block size that is no power of two; a window shorter than it
    (3, 3, 80, 16, None),   # a head size that is no power of two
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_paged_attention_matches_the_reference(
        num_heads: int, num_kv_heads: int, head_size: int, block_size: int,
        window: int | None, dtype: torch.dtype, device: str) -> None:
    # Decodes (one over exactly two blocks), a chunk over a cached prefix, a full prompt
    # ending on a block boundary, a one-token prompt.
    query_lens = [1, 9, 2 * block_size, 1, 1]
    seq_lens = [2 * block_size, 3 * block_size + 5, 2 * block_size, 1, 70]
    batch = make_batch(query_lens, seq_lens, block_size, 24, device)
    cache = random_cache(24, block_size, num_kv_heads, head_size, dtype, device)
    query = torch.randn(sum(query_lens) + 3, num_heads, head_size).to(dtype).to(device)
    output = torch.full_like(query, float("nan"))
    args: dict[str, Any] = {"scale": head_size ** -0.5, "sliding_window": window}
    paged_attention(output, query, cache[0], cache[1], batch, **args)
    expected = paged_attention_reference(query, cache[0], cache[1], batch, **args)
    n = batch.num_actual_tokens
    torch.testing.assert_close(output[:n].float(), expected[:n], atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])
    assert output[n:].isnan().all()  # padding rows past the last request: untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_only_batches_use_the_small_tiles_and_agree(dtype: torch.dtype,
                                                           device: str) -> None:
    batch = make_batch([1, 1, 1], [40, 3, 129], 16, 20, device, seed=3)
    assert batch.is_decode_only
    cache = random_cache(20, 16, 2, 64, dtype, device)
    query = torch.randn(3, 8, 64).to(dtype).to(device)
    output = torch.empty_like(query)
    paged_attention(output, query, cache[0], cache[1], batch, scale=0.125, sliding_window=None)
    expected = paged_attention_reference(query, cache[0], cache[1], batch, scale=0.125,
                                         sliding_window=None)
    torch.testing.assert_close(output.float(), expected, atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])


class _Recorder:
    """Stands in for a jitted kernel: records each launch's grid and host arguments."""

    def __init__(self, kernel: Any, launches: list[tuple[Any, ...]]) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            host = [a for a in args if not isinstance(a, torch.Tensor)]
            pointers = [a.data_ptr() for a in args if isinstance(a, torch.Tensor)]
            self.launches.append((grid, tuple(host), tuple(sorted(kwargs.items())),
                                  tuple(pointers)))
            self.kernel[grid](*args, **kwargs)
        return launch


def test_a_launch_depends_on_batch_sizes_only_not_on_values(
        monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    """What makes the backend's UNIFORM_BATCH graph claim true: two decode batches with the
    same counts but other lengths, blocks and slots, in the same buffers, launch the same
    kernels with the same grids and host arguments (a captured graph would replay them)."""
    launches: list[tuple[Any, ...]] = []
    for name in ("_paged_attention_kernel", "_reshape_and_cache_kernel"):
        monkeypatch.setattr(paged_kernels, name,
                            _Recorder(getattr(paged_kernels, name), launches))
    cache = torch.zeros(2, 30, 16, 2, 64, device=device)
    query = torch.randn(4, 4, 64, device=device)
    key, value = torch.randn(2, 4, 2, 64, device=device)
    output = torch.empty_like(query)
    buffers: PagedBatch | None = None
    for seed, seq_lens in ((0, [5, 17, 32, 1]), (1, [90, 2, 16, 33])):
        batch = make_batch([1, 1, 1, 1], seq_lens, 16, 30, device, seed=seed, width=8)
        if buffers is None:
            buffers = batch
        else:  # the engine's persistent buffers: new values, same tensors
            for field in ("query_start_loc", "seq_lens", "slot_mapping"):
                getattr(buffers, field).copy_(getattr(batch, field))
            buffers.block_table.copy_(batch.block_table)
            batch = buffers
        reshape_and_cache(key, value, cache[0], cache[1], batch.slot_mapping)
        paged_attention(output, query, cache[0], cache[1], batch, scale=0.125,
                        sliding_window=None)
        expected = paged_attention_reference(query, cache[0], cache[1], batch, scale=0.125,
                                             sliding_window=None)
        torch.testing.assert_close(output.float(), expected, atol=1e-5, rtol=1e-5)
    assert len(launches) == 4
    assert launches[0] == launches[2] and launches[1] == launches[3]
