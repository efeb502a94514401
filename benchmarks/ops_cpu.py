"""The built-in ops on the CPU: their C++ path (``forward_cpu``) vs the torch reference.

Shapes of the benchmark model (hidden 768, 12/4 heads of 64, intermediate 2560) at a
decode batch of 1 and 64 tokens and a prefill step of 2048; microseconds per call, best of
several timed loops, each op on fresh clones of its inputs where it works in place.

    .venv/bin/python benchmarks/ops_cpu.py [--threads 2] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from engine.kernels.cpu.native import native_kernels
from engine.kernels.cpu.ops import CpuRMSNorm as RMSNorm
from engine.kernels.cpu.ops import CpuRotaryEmbedding as RotaryEmbedding
from engine.kernels.cpu.ops import CpuSiluAndMul as SiluAndMul
from engine.sdk.ops import RotaryEmbeddingOp

HIDDEN, HEADS, KV_HEADS, HEAD_SIZE, INTERMEDIATE = 768, 12, 4, 64, 2560


def best_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(5):
        fn()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def cases(tokens: int, dtype: torch.dtype, key: str) -> dict[str, Callable[[], object]]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    residual = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    norm = RMSNorm(HIDDEN, dtype=dtype, dispatch_key=key)
    cache = RotaryEmbeddingOp.default_cos_sin_cache(HEAD_SIZE, 4096)
    rope = RotaryEmbedding(HEAD_SIZE, HEAD_SIZE, cache, dispatch_key=key)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_SIZE, generator=gen).to(dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    q_end, k_end = HEADS * HEAD_SIZE, (HEADS + KV_HEADS) * HEAD_SIZE
    query = qkv[:, :q_end].view(tokens, HEADS, HEAD_SIZE)
    key_heads = qkv[:, q_end:k_end].view(tokens, KV_HEADS, HEAD_SIZE)
    gate_up = torch.randn(tokens, 2 * INTERMEDIATE, generator=gen).to(dtype)
    silu = SiluAndMul(dispatch_key=key)
    # In place on the same buffers each call: the values drift, the work does not.
    return {
        "rms_norm + residual": lambda: norm(x, residual),
        "rms_norm": lambda: norm(x),
        "rotary_embedding": lambda: rope(positions, query, key_heads),
        "silu_and_mul": lambda: silu(gate_up),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args()
    if native_kernels() is None:
        raise SystemExit("the CPU kernels cannot be built here (no C++ compiler?)")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {args.threads} threads, {args.dtype}; us per call, "
          f"best of 5 loops")
    print("| op | tokens | reference us | cpu us | reference / cpu |")
    print("|---|---|---|---|---|")
    with torch.inference_mode():
        for tokens in (1, 64, 2048):
            calls = 200 if tokens < 2048 else 20
            reference, fast = cases(tokens, dtype, "native"), cases(tokens, dtype, "cpu")
            for name in reference:
                ref_us, cpu_us = best_us(reference[name], calls), best_us(fast[name], calls)
                print(f"| {name} | {tokens} | {ref_us:.1f} | {cpu_us:.1f} | "
                      f"{ref_us / cpu_us:.2f} |")


if __name__ == "__main__":
    main()
