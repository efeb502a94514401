"""Offline throughput: the engine vs transformers ``generate`` on the same workload.

Default workload (DEVELOPERS.md): 64 prompts x 32 random token ids, 128 new tokens, greedy,
EOS ignored, bfloat16, on a random-initialised Llama (hidden 768, 12 layers, 12 heads,
4 KV heads, intermediate 2560, vocab 8192; ~102M parameters) and on the default model.

    .venv/bin/python benchmarks/throughput.py                  # both models
    .venv/bin/python benchmarks/throughput.py --model random --dtype float32
    .venv/bin/python benchmarks/throughput.py --profile        # where the engine's time goes
    .venv/bin/python benchmarks/throughput.py --in-process     # EngineCore in this process
    .venv/bin/python benchmarks/throughput.py --model random --tensor-parallel-size 2

``LLM`` runs EngineCore in its own process (as ``engine serve`` does) unless
``--in-process``. ``--tensor-parallel-size`` and ``--distributed-executor-backend`` go to
the engine only (default: ``uni`` for one rank, ``mp`` for more); ``--threads`` is per rank
for the engine (default: the cores divided by the ranks) and the whole of transformers'.

Prints one table: generated tokens per second for each system and the engine's ratio.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (num, length), generator=gen).tolist()


def run_engine(model: str | None, prompts: list[list[int]], args: argparse.Namespace) -> float:
    from engine.core import LLM, SamplingParams

    llm = LLM(model, dtype=args.dtype, max_model_len=args.input_len + args.output_len + 16,
              max_num_seqs=max(len(prompts), 1), num_threads=args.threads,
              tensor_parallel_size=args.tensor_parallel_size,
              distributed_executor_backend=args.distributed_executor_backend,
              in_process=args.in_process or args.profile)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]],
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    profiler = cProfile.Profile() if args.profile else None
    start = time.perf_counter()
    if profiler:
        profiler.enable()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    if profiler:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    llm.shutdown()
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert generated == len(prompts) * args.output_len
    return generated / elapsed


def run_transformers(model_dir: Path, gguf_file: str | None, prompts: list[list[int]],
                     args: argparse.Namespace) -> float:
    from transformers import AutoModelForCausalLM

    hf: Any = AutoModelForCausalLM.from_pretrained(
        model_dir, gguf_file=gguf_file, dtype=DTYPES[args.dtype]).eval()
    ids = torch.tensor(prompts)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None,
                  pad_token_id=0)
    with torch.inference_mode():
        hf.generate(ids, max_new_tokens=2, min_new_tokens=2, **kwargs)  # warm-up, same batch
        start = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=args.output_len, min_new_tokens=args.output_len,
                          **kwargs)
        elapsed = time.perf_counter() - start
    return (out.shape[1] - ids.shape[1]) * len(prompts) / elapsed


def bench_model(name: str, args: argparse.Namespace, workdir: Path) -> tuple[float, float | None]:
    from engine.core.model_loader import resolve_model
    from engine.testing.models import BENCH_LLAMA_100M, build_random_llama

    if name == "random":
        path = build_random_llama(workdir / "llama-100m", BENCH_LLAMA_100M)
        model, model_dir, gguf_file, vocab = str(path), path, None, BENCH_LLAMA_100M["vocab_size"]
    else:
        source = resolve_model(None if name == "default" else name)
        model, model_dir, gguf_file = (None if name == "default" else name), source.path, (
            source.gguf_file)
        vocab = 49152 if name == "default" else 32000
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    engine_tps = run_engine(model, prompts, args)
    hf_tps = None if args.skip_transformers else run_transformers(model_dir, gguf_file,
                                                                  prompts, args)
    return engine_tps, hf_tps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", action="append",
                        help="random, default, or a path (repeatable; default: random+default)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the engine's run (implies --in-process)")
    parser.add_argument("--in-process", action="store_true",
                        help="EngineCore in the benchmark's process (default: its own)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="the engine's tensor-parallel ranks (worker processes)")
    parser.add_argument("--distributed-executor-backend", choices=["uni", "mp", "ray"],
                        default=None, help="the engine's executor (default: uni for one "
                        "rank, mp for more)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.model or ["random", "default"]:
            rows.append((name, *bench_model(name, args, Path(tmp))))
    tp = args.tensor_parallel_size
    backend = args.distributed_executor_backend or ("uni" if tp == 1 else "mp")
    rank_threads = args.threads or max(1, len(os.sched_getaffinity(0)) // tp)  # as the worker
    print(f"\nworkload: {args.num_prompts} prompts x {args.input_len} tokens -> "
          f"{args.output_len} new tokens, greedy, EOS ignored, {args.dtype}; transformers "
          f"{torch.get_num_threads()} threads; engine TP={tp} ({backend}), {rank_threads} "
          f"threads per rank")
    print(f"{'model':<10} {'engine tok/s':>14} {'transformers tok/s':>20} {'ratio':>8}")
    for name, engine_tps, hf_tps in rows:
        hf = f"{hf_tps:20.1f}" if hf_tps else f"{'-':>20}"
        ratio = f"{engine_tps / hf_tps:8.2f}" if hf_tps else f"{'-':>8}"
        print(f"{name:<10} {engine_tps:14.1f} {hf} {ratio}")


if __name__ == "__main__":
    main()
