"""The CPU attention backends side by side: ``cpu`` (C++ paged kernel) vs ``torch`` (SDPA).

The attention of one step of the benchmark model (12 layers, each with its own KV cache
of 2048 blocks of 16 tokens; 12 query heads, 4 KV heads, head size 64, bf16), per step
shape: the metadata built once, then each layer's KV write and attention; the requests'
blocks scattered over the pool; best of several timed loops.

    .venv/bin/python benchmarks/attention_cpu.py [--threads 2] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import torch

from engine.core.attention import TorchAttentionBackend
from engine.core.worker.kv_cache import zeroed
from engine.kernels.cpu.attention import CpuAttentionBackend
from engine.sdk.attention import (
    AttentionBackend,
    AttentionContext,
    AttentionImplParams,
    AttentionSpec,
    CommonAttentionMetadata,
)

HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 12, 4, 64, 16
POOL_BLOCKS = 2048
LAYERS = 12

# (name, [(cached tokens, new tokens) per request])
SHAPES = [
    ("decode 1 x ctx 96", [(95, 1)]),
    ("decode 64 x ctx 48", [(47, 1)] * 64),
    ("decode 64 x ctx 96", [(95, 1)] * 64),
    ("decode 64 x ctx 160", [(159, 1)] * 64),
    ("decode 64, ctx 40..160 (mixed)", [(40 + 2 * i, 1) for i in range(64)]),
    ("60 decodes ctx 100 + 4 prompts of 32", [(100, 1)] * 60 + [(0, 32)] * 4),
    ("4 prompts of 32", [(0, 32)] * 4),
    ("4 prompts of 64", [(0, 64)] * 4),
    ("2 chunks of 64 after 512", [(512, 64)] * 2),
    ("1 prompt of 1024", [(0, 1024)]),
]


def common_metadata(reqs: list[tuple[int, int]], gen: torch.Generator) -> CommonAttentionMetadata:
    order = (torch.randperm(POOL_BLOCKS - 1, generator=gen) + 1).tolist()
    rows, slots = [], []
    width = max(math.ceil((c + n) / BLOCK) for c, n in reqs)
    for cached, new in reqs:
        blocks = [order.pop() for _ in range(math.ceil((cached + new) / BLOCK))]
        rows.append(blocks + [0] * (width - len(blocks)))
        slots += [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached, cached + new)]
    qlens = torch.tensor([n for _, n in reqs], dtype=torch.int32)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int32), qlens.cumsum(0).to(torch.int32)])
    seq_lens = torch.tensor([c + n for c, n in reqs], dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq_lens, seq_lens_cpu=seq_lens,
        block_table=torch.tensor(rows, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64), num_reqs=len(reqs),
        num_actual_tokens=int(qsl[-1]), max_query_len=int(qlens.max()),
        max_seq_len=int(seq_lens.max()))


def best_ms(fn: Callable[[], None], loops: int = 5, repeats: int = 7) -> float:
    for _ in range(2):
        fn()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(loops):
            fn()
        best = min(best, (time.perf_counter() - start) / loops)
    return best * 1e3


def step_ms(backend: type[AttentionBackend], reqs: list[tuple[int, int]], dtype: torch.dtype,
            caches: list[torch.Tensor]) -> float:
    name = str(dtype).removeprefix("torch.")
    spec = AttentionSpec(num_heads=HEADS, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE,
                         dtype=name, kv_cache_dtype=name, block_size=BLOCK)
    ctx = AttentionContext(spec=spec, layer_names=("l0",), device="cpu", max_num_reqs=256,
                           max_num_batched_tokens=8192, max_model_len=4096)
    impl = backend.get_impl_cls()(AttentionImplParams(spec=spec, layer_name="l0",
                                                      scale=HEAD_SIZE ** -0.5))
    builder = backend.get_builder_cls()(ctx)
    common = common_metadata(reqs, torch.Generator().manual_seed(0))
    tokens = common.num_actual_tokens
    query = torch.randn(tokens, HEADS, HEAD_SIZE).to(dtype)
    key = torch.randn(tokens, KV_HEADS, HEAD_SIZE).to(dtype)
    out = torch.empty_like(query)

    def step() -> None:
        metadata = builder.build(common)
        for cache in caches:
            impl.forward(query, key, key, cache, metadata, out)

    return best_ms(step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    shape = CpuAttentionBackend.get_kv_cache_shape(POOL_BLOCKS, BLOCK, KV_HEADS, HEAD_SIZE)
    # Allocated as the engine allocates its KV cache (huge pages where the OS gives them),
    # then filled.
    caches = [zeroed(shape, dtype, torch.device("cpu")).normal_() for _ in range(LAYERS)]
    flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")
             if f in open("/proc/cpuinfo").read()]
    print(f"torch {torch.__version__}, {args.threads} threads, {args.dtype}, cpu flags: "
          f"{' '.join(flags)}; {LAYERS} layers of {HEADS}/{KV_HEADS} heads, head size "
          f"{HEAD_SIZE}, block {BLOCK}; ms per step (metadata + {LAYERS} x (KV write + "
          f"attention)), best of 7")
    print("| step | torch ms | cpu ms | torch / cpu |")
    print("|---|---|---|---|")
    for name, reqs in SHAPES:
        torch_ms = step_ms(TorchAttentionBackend, reqs, dtype, caches)
        cpu_ms = step_ms(CpuAttentionBackend, reqs, dtype, caches)
        print(f"| {name} | {torch_ms:.3f} | {cpu_ms:.3f} | {torch_ms / cpu_ms:.2f} |")


if __name__ == "__main__":
    main()
