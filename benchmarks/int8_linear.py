"""The ``int8`` method's W8A8 kernel against the bf16 matmul, on the ~100M model's shapes.

    .venv/bin/python benchmarks/int8_linear.py [--tokens 1 64] [--layers 12] [--iters 20]

For each shape (input x output features of the benchmark Llama: qkv 768x2304... as the
issue lists them: 768x2304, 768x5120, 2560x768) and each token count it times

* ``bf16``: ``F.linear`` on a bfloat16 weight (kernel ``torch``, what the engine runs
  unquantized on this CPU);
* ``int8_int_mm``: the whole W8A8 kernel: per-token activation quantization,
  ``torch._int_mm`` (oneDNN, AVX512-VNNI where present) and the rescale to bf16;
* ``_int_mm only``: the int8 x int8 -> int32 product alone (the kernel's floor),

cycling through ``--layers`` weight copies so weights stream from memory as in a model
(best of ``--repeats`` timings). Each row also checks the kernel against float math
(relative error of the output).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.core.quantization.int8_kernels import Int8IntMMKernel, quantize_tokens
from engine.core.quantization.int8_method import quantize_per_channel
from engine.sdk.linear_kernel import LinearKernelConfig

SHAPES = ((768, 2304), (768, 5120), (2560, 768))  # (input features, output features)


def seconds(calls: list[Callable[[], object]], iters: int) -> float:
    """Seconds per call, cycling through ``calls`` (one per weight copy)."""
    for call in calls:
        call()
    start = time.perf_counter()
    for _ in range(iters):
        for call in calls:
            call()
    return (time.perf_counter() - start) / iters / len(calls)


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            flags = next(line for line in info if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    wanted = ("avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_int8", "amx_bf16")
    return " ".join(f for f in wanted if f in flags) or "none of " + ", ".join(wanted)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3, help="best of this many timings")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, cpu flags: "
          f"{cpu_flags()}, {args.layers} weight copies")
    print(f"{'in x out':>11} {'tokens':>6} {'bf16 ms':>9} {'int8 ms':>9} {'_int_mm ms':>11} "
          f"{'bf16 GFLOP/s':>13} {'int8 GFLOP/s':>13} {'speed-up':>9} {'rel err':>8}")
    for in_f, out_f in SHAPES:
        weights = [torch.randn(out_f, in_f) * 0.05 for _ in range(args.layers)]
        dense = [w.to(torch.bfloat16) for w in weights]
        layers = []
        for w in weights:
            layer = torch.nn.Module()
            q, scale = quantize_per_channel(w)
            layer.weight = torch.nn.Parameter(q, requires_grad=False)
            layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
            layers.append(layer)
        config = LinearKernelConfig(scheme="int8_w8a8", weight_dtype="int8",
                                    act_dtype="bfloat16", input_size=in_f, output_size=out_f)
        kernel = Int8IntMMKernel(config)
        for tokens in args.tokens:
            x = torch.randn(tokens, in_f, dtype=torch.bfloat16)
            xq, _ = quantize_tokens(x)
            runs = {
                "bf16": [lambda w=w, x=x: F.linear(x, w) for w in dense],
                "int8": [lambda lay=lay, x=x, k=kernel: k.apply(lay, x) for lay in layers],
                "mm": [lambda lay=lay, q=xq: torch._int_mm(q, lay.weight.t()) for lay in layers],
            }
            best = {name: min(seconds(calls, args.iters) for _ in range(args.repeats))
                    for name, calls in runs.items()}
            t_bf16, t_int8, t_mm = best["bf16"], best["int8"], best["mm"]
            exact = F.linear(x.float(), weights[0])
            error = float((kernel.apply(layers[0], x).float() - exact).norm() / exact.norm())
            flops = 2 * tokens * in_f * out_f
            print(f"{in_f:>5}x{out_f:<5} {tokens:>6} {t_bf16 * 1e3:9.3f} {t_int8 * 1e3:9.3f} "
                  f"{t_mm * 1e3:11.3f} {flops / t_bf16 / 1e9:13.1f} {flops / t_int8 / 1e9:13.1f} "
                  f"{t_bf16 / t_int8:9.2f} {error:8.4f}")


if __name__ == "__main__":
    main()
