"""The CPU attention backends (``torch``, ``cpu``) against a per-request reference."""

from __future__ import annotations

import math

import pytest
import torch

from engine.core.attention import TorchAttentionBackend
from engine.kernels.cpu.attention import CpuAttentionBackend
from engine.kernels.cpu.native import library
from engine.sdk.attention import (
    AttentionContext,
    AttentionImplParams,
    AttentionSpec,
    CommonAttentionMetadata,
)

BLOCK = 4
HEADS, KV_HEADS = 4, 2
BACKENDS = [TorchAttentionBackend, CpuAttentionBackend]


def reference(q, k_ctx, v_ctx, start, scale, window):
    """Attention of queries at positions start.. over keys 0..pos (per request, naive)."""
    out = []
    groups = HEADS // KV_HEADS
    for i in range(q.shape[0]):
        pos = start + i
        lo = 0 if window is None else max(0, pos - window + 1)
        k = k_ctx[lo:pos + 1].repeat_interleave(groups, dim=1)  # [n, H, D]
        v = v_ctx[lo:pos + 1].repeat_interleave(groups, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[i].float(), k.float()) * scale
        out.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v.float()))
    return torch.stack(out)


MIXED = [(7, 1), (0, 9), (12, 1), (5, 6), (0, 1), (3, 2), (20, 1), (0, 30), (2, 40)]
EQUAL_DECODES = [(9, 1)] * 5  # one context length: the unmasked path


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize("head_size", [8, 64])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reqs", [MIXED, EQUAL_DECODES], ids=["mixed", "equal_decodes"])
def test_mixed_prefill_decode_batch_matches_reference(backend, head_size, window, dtype,
                                                      reqs) -> None:
    D = head_size
    gen = torch.Generator().manual_seed(0)
    # (cached tokens, new tokens) per request: decodes, chunks with a prefix, full prompts
    num_blocks = 96
    spec = AttentionSpec(num_heads=HEADS, num_kv_heads=KV_HEADS, head_size=D,
                         dtype=str(dtype).split(".")[1], kv_cache_dtype=str(dtype).split(".")[1],
                         block_size=BLOCK, sliding_window=window)
    shape = backend.get_kv_cache_shape(num_blocks, BLOCK, KV_HEADS, D)
    cache = torch.zeros(shape, dtype=dtype)
    free = list(range(1, num_blocks))
    perm = torch.randperm(len(free), generator=gen).tolist()
    free = [free[i] for i in perm]
    contexts, block_rows, slots, queries, keys, values = [], [], [], [], [], []
    max_blocks = max(math.ceil((c + n) / BLOCK) for c, n in reqs)
    for cached, new in reqs:
        total = cached + new
        blocks = [free.pop() for _ in range(math.ceil(total / BLOCK))]
        k_all = torch.randn(total, KV_HEADS, D, generator=gen).to(dtype)
        v_all = torch.randn(total, KV_HEADS, D, generator=gen).to(dtype)
        for p in range(cached):  # the prefix is already in the cache ([block, head, pos, D])
            cache[0, blocks[p // BLOCK], :, p % BLOCK] = k_all[p]
            cache[1, blocks[p // BLOCK], :, p % BLOCK] = v_all[p]
        slots += [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached, total)]
        queries.append(torch.randn(new, HEADS, D, generator=gen).to(dtype))
        keys.append(k_all[cached:])
        values.append(v_all[cached:])
        contexts.append((k_all, v_all, cached))
        block_rows.append(blocks + [0] * (max_blocks - len(blocks)))
    qlens = torch.tensor([n for _, n in reqs], dtype=torch.int32)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int32), qlens.cumsum(0).to(torch.int32)])
    seq_lens = torch.tensor([c + n for c, n in reqs], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq_lens, seq_lens_cpu=seq_lens,
        block_table=torch.tensor(block_rows, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64), num_reqs=len(reqs),
        num_actual_tokens=int(qsl[-1]), max_query_len=int(qlens.max()),
        max_seq_len=int(seq_lens.max()),
    )
    ctx = AttentionContext(spec=spec, layer_names=("l0",), device="cpu", max_num_reqs=16,
                           max_num_batched_tokens=256, max_model_len=128)
    metadata = backend.get_builder_cls()(ctx).build(common)
    scale = D**-0.5
    impl = backend.get_impl_cls()(
        AttentionImplParams(spec=spec, layer_name="l0", scale=scale))
    q, k, v = torch.cat(queries), torch.cat(keys), torch.cat(values)
    out = torch.full_like(q, float("nan"))
    impl.forward(q, k, v, cache, metadata, out)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for i, (k_all, v_all, cached) in enumerate(contexts):
        lo, hi = int(qsl[i]), int(qsl[i + 1])
        expected = reference(q[lo:hi], k_all, v_all, cached, scale, window)
        torch.testing.assert_close(out[lo:hi].float(), expected, atol=tol, rtol=tol)
    # The new keys/values landed in their slots.
    slot_t = torch.tensor(slots)
    torch.testing.assert_close(cache[0][slot_t // BLOCK, :, slot_t % BLOCK], k)


def test_supports_reports_reasons() -> None:
    ok = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=8, dtype="float32",
                       kv_cache_dtype="float32", block_size=16)
    assert TorchAttentionBackend.supports(ok).ok
    bad = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=8, dtype="float32",
                        kv_cache_dtype="bfloat16", block_size=16)
    assert "kv_cache_dtype" in TorchAttentionBackend.supports(bad).reason


def test_cpu_backend_supports_reports_reasons() -> None:
    spec = dict(num_heads=4, num_kv_heads=2, head_size=8, kv_cache_dtype="float16",
                block_size=16)
    reason = CpuAttentionBackend.supports(AttentionSpec(dtype="float16", **spec)).reason
    assert "dtype float16 not supported; supported: float32, bfloat16" in reason
    assert "--attention-backend torch" in reason


def test_without_a_compiler_the_platform_falls_back_to_torch(monkeypatch, caplog) -> None:
    from engine.core.platforms import CpuPlatform
    from engine.sdk import native

    monkeypatch.setattr(native, "find_compiler", lambda: None)
    library.load.cache_clear()
    try:
        spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=8, dtype="float32",
                             kv_cache_dtype="float32", block_size=16)
        support = CpuAttentionBackend.supports(spec)
        assert not support
        assert "no C++ compiler found" in support.reason
        with caplog.at_level("WARNING"):
            assert CpuPlatform.default_attention_backend(spec) == "torch"
        assert "using the torch backend" in caplog.text
    finally:
        library.load.cache_clear()


def test_a_failed_build_reports_the_compiler_output(monkeypatch, tmp_path) -> None:
    bad = tmp_path / "bad.cpp"
    bad.write_text("this is not C++\n")
    monkeypatch.setattr(library, "SOURCES", {bad: ()})
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    library.load.cache_clear()
    try:
        with pytest.raises(library.NativeBuildError, match="bad.cpp.*failed"):
            library.load()
        assert not list((tmp_path / "cache").rglob("*.so"))  # nothing half-built left
    finally:
        library.load.cache_clear()


def test_loading_the_kernels_keeps_denormals() -> None:
    # Linked with -ffast-math, GCC < 13 would add a constructor that flushes denormals to
    # zero in the loading process, changing torch's numerics everywhere.
    library.load()
    tiny = torch.tensor([1e-39], dtype=torch.float32)
    assert (tiny * 1.5).item() != 0.0


def test_the_kernels_refuse_layouts_they_would_misread() -> None:
    kernels = library.load()
    cache = torch.zeros(2, 4, 2, 4, 8)
    index = torch.zeros(1, dtype=torch.int32)
    query = torch.zeros(1, 4, 8)
    with pytest.raises(ValueError, match="paged_attention: expected .* all torch.float32"):
        kernels.paged_attention(query.to(torch.bfloat16), cache[0], cache[1],
                                torch.zeros(1, 1, dtype=torch.int32), index, index, query,
                                1.0, None)
    with pytest.raises(ValueError, match="index tensors must be torch.int32"):
        kernels.paged_attention(query, cache[0], cache[1], torch.zeros(1, 1), index, index,
                                query, 1.0, None)
    with pytest.raises(ValueError, match="write_kv: expected"):
        kernels.write_kv(torch.zeros(1, 2, 8)[:, :, ::2], torch.zeros(1, 2, 4), cache[0],
                         cache[1], torch.zeros(1, dtype=torch.int64))


def test_an_unwritable_cache_directory_is_reported(monkeypatch, tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the cache directory would go
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(blocker / "engine"))
    library.load.cache_clear()
    try:
        with pytest.raises(library.NativeBuildError, match="set ENGINE_CACHE_DIR"):
            library.load()
    finally:
        library.load.cache_clear()
