"""The built-in linear kernels side by side on the layer shapes of the benchmark model.

    .venv/bin/python benchmarks/linear_kernels.py [--tokens 1 2 3 4 64] [--dtype bfloat16]

For each layer shape of the ~100M Llama (hidden 768, intermediate 2560, vocab 8192) it
times ``F.linear`` (kernel ``torch``), the prepacked oneDNN kernel (``onednn``) and the
``cpu`` kernel (the engine's C++: 1-3 rows on the dense weight, more on the weight packed
into column panels, where this CPU has it) and prints each one's rate: GB/s of weights
streamed for a few rows (decode steps of small batches are bound by memory), GFLOP/s from
16 rows up; then the last column, ``cpu`` over ``onednn``. It checks first that all give
the same result. Each timing cycles through ``--layers`` copies of the weight (12, one
per layer of the model), so weights come from memory as in a real forward pass;
``--layers 1`` times one weight that stays in the caches, which flatters small batches.
The last rows sum one whole step (the 49 products of the model).
"""

from __future__ import annotations

import argparse
import time

import torch

from engine.core.model_executor.linear_kernels import TorchLinearKernel
from engine.kernels.cpu.linear import CpuLinearKernel, OneDNNLinearKernel
from engine.sdk.linear_kernel import LinearKernelConfig

SHAPES = {"qkv_proj": (1280, 768), "o_proj": (768, 768), "gate_up_proj": (5120, 768),
          "down_proj": (768, 2560), "lm_head": (8192, 768)}
#: How many of each layer one forward pass runs (12 layers, one head).
PER_STEP = {"qkv_proj": 12, "o_proj": 12, "gate_up_proj": 12, "down_proj": 12, "lm_head": 1}


def time_kernel(pairs, x, iters: int) -> float:
    """Seconds per call, cycling through ``(kernel, layer)`` pairs (one per model layer)."""
    for kernel, layer in pairs:
        kernel.apply(layer, x)
    start = time.perf_counter()
    for _ in range(iters):
        for kernel, layer in pairs:
            kernel.apply(layer, x)
    return (time.perf_counter() - start) / iters / len(pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 4, 64])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--layers", type=int, default=12,
                        help="weight copies cycled through (1: cache-resident)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    classes = [TorchLinearKernel, OneDNNLinearKernel]
    probe = LinearKernelConfig(scheme="unquantized", weight_dtype=args.dtype,
                               act_dtype=args.dtype, input_size=768, output_size=768)
    answer = CpuLinearKernel.can_implement(probe)
    if answer.ok:
        classes.append(CpuLinearKernel)
    else:
        print(f"cpu kernel: not measured ({answer.reason})")
    names = [cls.name for cls in classes]
    print(f"{args.dtype}, {torch.get_num_threads()} threads, {args.layers} weight copies; "
          f"GB/s of weights below 16 rows, GFLOP/s from 16")
    print(f"{'layer':<14} {'shape':>10} {'rows':>4} " + " ".join(f"{n:>8}" for n in names)
          + f" {'cpu/onednn':>10}")
    step: dict[int, list[float]] = {}
    for name, (out_f, in_f) in SHAPES.items():
        config = LinearKernelConfig(scheme="unquantized", weight_dtype=args.dtype,
                                    act_dtype=args.dtype, input_size=in_f, output_size=out_f)
        layers = []
        for _ in range(args.layers):
            layer = torch.nn.Module()
            layer.weight = torch.nn.Parameter(torch.randn(out_f, in_f).to(dtype),
                                              requires_grad=False)
            layers.append(layer)
        kernels = [[cls(config) for _ in layers] for cls in classes]
        for per_layer in kernels:
            for kernel, layer in zip(per_layer, layers, strict=True):
                kernel.process_weights_after_loading(layer)
        for tokens in args.tokens:
            x = torch.randn(tokens, in_f).to(dtype)
            want = kernels[0][0].apply(layers[0], x).float()
            for per_layer in kernels[1:]:  # sums of up to 2560 terms in another order
                torch.testing.assert_close(per_layer[0].apply(layers[0], x).float(), want,
                                           rtol=2e-2 if dtype == torch.bfloat16 else 1e-4,
                                           atol=5e-1 if dtype == torch.bfloat16 else 1e-3)
            seconds = [time_kernel(list(zip(per_layer, layers, strict=True)), x, args.iters)
                       for per_layer in kernels]
            totals = step.setdefault(tokens, [0.0] * len(kernels))
            for i, s in enumerate(seconds):
                totals[i] += s * PER_STEP[name]
            work = (out_f * in_f * dtype.itemsize if tokens < 16 else 2 * tokens * in_f * out_f)
            rates = " ".join(f"{work / s / 1e9:8.1f}" for s in seconds)
            ratio = f"{seconds[1] / seconds[2]:10.2f}" if len(seconds) > 2 else ""
            print(f"{name:<14} {f'{out_f}x{in_f}':>10} {tokens:>4} {rates} {ratio}")
    print("one forward pass's products, ms:")
    for tokens, totals in step.items():
        ratio = f"{totals[1] / totals[2]:10.2f}" if len(totals) > 2 else ""
        print(f"{'whole step':<14} {'':>10} {tokens:>4} "
              + " ".join(f"{t * 1e3:8.2f}" for t in totals) + f" {ratio}")


if __name__ == "__main__":
    main()
