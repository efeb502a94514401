"""The default model (SmolLM2-135M Q4_1 GGUF) dequantized at load vs kept packed (``gguf``).

    .venv/bin/python benchmarks/gguf_packed.py [--repeats 3] [--output-len 64]

Three engines on the same file, in this process, timed in turns (best of ``--repeats``):

* ``dequantized``: today's default, every GGUF tensor dequantized to bf16 when it loads;
* ``gguf``: ``--quantization gguf``, blocks kept packed; kernels by priority (``gguf_int4``
  for the Q4_1 layers, ``gguf_dequant`` for the Q8_0 LM head);
* ``gguf exact``: ``--quantization gguf --linear-kernel gguf_dequant`` (dequantize each
  layer into the scratch buffer, then the bf16 matmul: the same tokens as ``dequantized``).

Workloads: greedy, EOS ignored, 32-token random prompts, ``--output-len`` new tokens;
batch 1 (decode-bound) and batch 64 (offline throughput). Prints generated tokens/s, the
weights held (parameters, a tied table once) and whether greedy tokens equal the
dequantized engine's.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

CONFIGS: dict[str, dict[str, Any]] = {
    "dequantized": {},
    "gguf": {"quantization": "gguf"},
    "gguf exact": {"quantization": "gguf", "linear_kernel": "gguf_dequant"},
}


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters, each storage counted once."""
    seen: set[int] = set()
    total = 0
    for param in model.parameters():
        if param.data_ptr() not in seen:
            seen.add(param.data_ptr())
            total += param.numel() * param.element_size()
    return total


def main() -> None:
    from engine.core import LLM, SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 49152, (max(args.batches), 32), generator=gen).tolist()
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    engines = {name: LLM(None, in_process=True, max_model_len=128, num_kv_blocks=600,
                         max_num_seqs=max(args.batches), **kw) for name, kw in CONFIGS.items()}
    best: dict[tuple[str, int], float] = {}
    tokens: dict[tuple[str, int], list[list[int]]] = {}
    for llm in engines.values():  # warm-up
        llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4),
                     use_tqdm=False)
    for _ in range(args.repeats):
        for batch in args.batches:
            for name, llm in engines.items():
                inputs = [{"prompt_token_ids": p} for p in prompts[:batch]]
                start = time.perf_counter()
                outputs = llm.generate(inputs, params, use_tqdm=False)
                rate = batch * args.output_len / (time.perf_counter() - start)
                best[name, batch] = max(best.get((name, batch), 0.0), rate)
                tokens[name, batch] = [list(o.outputs[0].token_ids) for o in outputs]
    print(f"\nSmolLM2-135M-Instruct Q4_1 GGUF, bfloat16, {torch.get_num_threads()} threads, "
          f"32-token prompts -> {args.output_len} new tokens, best of {args.repeats}")
    header = "".join(f"{f'batch {b} tok/s':>16}" for b in args.batches)
    print(f"{'engine':<14}{'weights MB':>12}{header}{'same tokens':>13}")
    for name, llm in engines.items():
        model = llm.llm_engine.core.worker.model
        same = all(tokens[name, b] == tokens["dequantized", b] for b in args.batches)
        rates = "".join(f"{best[name, b]:16.1f}" for b in args.batches)
        print(f"{name:<14}{weight_bytes(model) / 1e6:12.1f}{rates}{same!s:>13}")
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
