"""Weights on 4 KiB pages against transparent huge pages, for the batch-1 product.

    .venv/bin/python benchmarks/huge_pages.py [--pairs 15] [--tokens 1]

Allocates the weights of the ~100M benchmark Llama twice (12 layers of qkv 1280x768, o
768x768, gate_up 5120x768, down 768x2560, and the 8192x768 LM head; bfloat16 where this
CPU multiplies it, else float32): once from ``malloc`` as the process started, once in an
anonymous mapping with ``madvise(MADV_HUGEPAGE)`` (what ``glibc.malloc.hugetlb=1`` does
for the EngineCore process, ``engine.core.rpc.huge_pages``). Then it times a pass of the
engine's small-batch product over all of them, alternating the two copies pair by pair
(the machine's bandwidth drifts; the pairs share it), and prints GB/s of weights streamed
and the median ratio. Linux only; the ``AnonHugePages`` line says whether the kernel
granted huge pages at all (``/sys/kernel/mm/transparent_hugepage/enabled`` at ``never``
gives none).
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import sys
import time
from pathlib import Path

import torch

from engine.kernels.cpu.native import native_kernels

SHAPES = [(1280, 768), (768, 768), (5120, 768), (768, 2560)] * 12 + [(8192, 768)]
HUGE_PAGE = 2 << 20


def on_huge_pages(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor in a 2 MiB-aligned anonymous mapping advised for THP."""
    size = rows * cols * dtype.itemsize
    area = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -torch.frombuffer(area, dtype=torch.uint8).data_ptr() % HUGE_PAGE
    area.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(area, dtype=dtype, count=rows * cols,
                            offset=start).view(rows, cols)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=15)
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if not sys.platform.startswith("linux"):
        sys.exit("transparent huge pages: Linux only")
    kernels = native_kernels()
    if kernels is None:
        sys.exit("the engine's CPU kernels are not built here")
    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if torch.bfloat16 in kernels.small_matmul_dtypes else torch.float32
    copies = {
        "4k": [torch.randn(n, k).to(dtype) for n, k in SHAPES],
        "huge": [on_huge_pages(n, k, dtype).copy_(torch.randn(n, k)) for n, k in SHAPES],
    }
    inputs = {k: torch.randn(args.tokens, k).to(dtype) for k in {k for _, k in SHAPES}}
    outs = [torch.empty(args.tokens, n, dtype=dtype) for n, _ in SHAPES]
    total = sum(n * k * dtype.itemsize for n, k in SHAPES)

    def one_pass(weights: list[torch.Tensor]) -> float:
        start = time.perf_counter()
        for weight, out in zip(weights, outs, strict=True):
            kernels.matmul(inputs[weight.shape[1]], weight, None, None, out)
        return time.perf_counter() - start

    huge_kb = next(line.split()[1] for line in Path("/proc/self/smaps_rollup").read_text()
                   .splitlines() if line.startswith("AnonHugePages"))
    print(f"{total / 1e6:.0f} MB of {str(dtype).removeprefix('torch.')} weights, "
          f"{args.tokens} token(s), {args.threads} threads; AnonHugePages {huge_kb} kB")
    print(f"{'pair':>4s}{'4k GB/s':>10s}{'huge GB/s':>11s}{'huge x':>8s}")
    ratios = []
    for pair in range(1, args.pairs + 1):
        rates = {}
        for name, weights in copies.items():
            one_pass(weights)
            rates[name] = total / min(one_pass(weights) for _ in range(5)) / 1e9
        ratios.append(rates["huge"] / rates["4k"])
        print(f"{pair:>4d}{rates['4k']:>10.1f}{rates['huge']:>11.1f}{ratios[-1]:>8.3f}")
    print(f"median huge pages x 4 KiB pages: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
