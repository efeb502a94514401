"""The built-in linear kernels side by side on the decode shapes of the benchmark model.

    .venv/bin/python benchmarks/linear_kernels.py [--tokens 1 16 64] [--dtype float32]

For each layer shape of the ~100M Llama (hidden 768, intermediate 2560, vocab 8192) it
times ``F.linear`` (kernel ``torch``) and the prepacked oneDNN kernel (``onednn``) and
prints GFLOP/s and the speed-up, after checking both give the same result. Each timing
cycles through ``--layers`` copies of the weight (12, one per layer of the model), so
weights come from memory as in a real forward pass; ``--layers 1`` times one weight that
stays in the caches, which flatters small batches.
"""

from __future__ import annotations

import argparse
import time

import torch

from engine.core.model_executor.linear_kernels import OneDNNLinearKernel, TorchLinearKernel
from engine.sdk.linear_kernel import LinearKernelConfig

SHAPES = {"qkv_proj": (1280, 768), "o_proj": (768, 768), "gate_up_proj": (5120, 768),
          "down_proj": (768, 2560), "lm_head": (8192, 768)}


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
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--dtype", default="float32", choices=["float32"])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--layers", type=int, default=12,
                        help="weight copies cycled through (1: cache-resident)")
    args = parser.parse_args()
    print(f"{args.dtype}, {torch.get_num_threads()} threads, {args.layers} weight copies")
    print(f"{'layer':<14} {'shape':>12} {'tokens':>6} {'torch GFLOP/s':>14} "
          f"{'onednn GFLOP/s':>15} {'speed-up':>9}")
    for name, (out_f, in_f) in SHAPES.items():
        config = LinearKernelConfig(scheme="unquantized", weight_dtype=args.dtype,
                                    act_dtype=args.dtype, input_size=in_f, output_size=out_f)
        layers = []
        for _ in range(args.layers):
            layer = torch.nn.Module()
            layer.weight = torch.nn.Parameter(torch.randn(out_f, in_f), requires_grad=False)
            layers.append(layer)
        kernels = {cls: [cls(config) for _ in layers]
                   for cls in (TorchLinearKernel, OneDNNLinearKernel)}
        for per_layer in kernels.values():
            for kernel, layer in zip(per_layer, layers, strict=True):
                kernel.process_weights_after_loading(layer)
        for tokens in args.tokens:
            x = torch.randn(tokens, in_f)
            torch.testing.assert_close(kernels[TorchLinearKernel][0].apply(layers[0], x),
                                       kernels[OneDNNLinearKernel][0].apply(layers[0], x),
                                       rtol=1e-4, atol=1e-3)  # sums of ~2560 terms
            flops = 2 * tokens * in_f * out_f
            rates = [flops / time_kernel(list(zip(per_layer, layers, strict=True)), x,
                                         args.iters) / 1e9
                     for per_layer in kernels.values()]
            print(f"{name:<14} {f'{out_f}x{in_f}':>12} {tokens:>6} {rates[0]:14.1f} "
                  f"{rates[1]:15.1f} {rates[1] / rates[0]:9.2f}")


if __name__ == "__main__":
    main()
