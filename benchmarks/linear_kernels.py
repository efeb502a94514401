"""The built-in linear kernels side by side on the decode shapes of the benchmark model.

    .venv/bin/python benchmarks/linear_kernels.py [--tokens 64] [--dtype float32]

For each layer shape of the ~100M Llama (hidden 768, intermediate 2560, vocab 8192) it
times ``F.linear`` (kernel ``torch``) and the prepacked oneDNN kernel (``onednn``) and
prints GFLOP/s and the speed-up, after checking both give the same result.
"""

from __future__ import annotations

import argparse
import time

import torch

from engine.core.model_executor.linear_kernels import OneDNNLinearKernel, TorchLinearKernel
from engine.sdk.linear_kernel import LinearKernelConfig

SHAPES = {"qkv_proj": (1280, 768), "o_proj": (768, 768), "gate_up_proj": (5120, 768),
          "down_proj": (768, 2560), "lm_head": (8192, 768)}


def time_kernel(kernel, layer, x, iters: int) -> float:
    for _ in range(3):
        kernel.apply(layer, x)
    start = time.perf_counter()
    for _ in range(iters):
        kernel.apply(layer, x)
    return (time.perf_counter() - start) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32"])
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    print(f"{args.tokens} tokens, {args.dtype}, {torch.get_num_threads()} threads")
    print(f"{'layer':<14} {'shape':>12} {'torch GFLOP/s':>14} {'onednn GFLOP/s':>15} "
          f"{'speed-up':>9}")
    for name, (out_f, in_f) in SHAPES.items():
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(torch.randn(out_f, in_f), requires_grad=False)
        config = LinearKernelConfig(scheme="unquantized", weight_dtype=args.dtype,
                                    act_dtype=args.dtype, input_size=in_f, output_size=out_f)
        x = torch.randn(args.tokens, in_f)
        kernels = [TorchLinearKernel(config), OneDNNLinearKernel(config)]
        for kernel in kernels:
            kernel.process_weights_after_loading(layer)
        torch.testing.assert_close(kernels[0].apply(layer, x), kernels[1].apply(layer, x),
                                   rtol=1e-4, atol=1e-4)
        flops = 2 * args.tokens * in_f * out_f
        rates = [flops / time_kernel(k, layer, x, args.iters) / 1e9 for k in kernels]
        print(f"{name:<14} {f'{out_f}x{in_f}':>12} {rates[0]:14.1f} {rates[1]:15.1f} "
              f"{rates[1] / rates[0]:9.2f}")


if __name__ == "__main__":
    main()
