"""Batch-1 decode: the engine against llama.cpp, in interleaved rounds, with the ratios.

One prompt of 32 random token ids, 128 new tokens, greedy, EOS ignored, 2 threads, on the
``llama-100m`` checkpoint of ``../shared/peers/setup.sh`` (HF directory for the engine, its
bf16 GGUF for llama.cpp; the engine at ``--dtype``, by default its pick for the CPU). Each
round runs ``llama-batched-bench -npl 1`` (its TG rate: decode tokens/s), then the engine in
a fresh process (``LLM``, EngineCore in its own process as by default): decode tokens/s as
127 over the time of a 128-token run less that of a 1-token run, best of 7 such pairs; then
llama.cpp again. A round's ratio is the engine over the better of its two llama.cpp runs.

    .venv/bin/python benchmarks/batch_one.py [--rounds 8] [--enforce-eager] [--isa avx2]

``--isa avx2``: both restricted to AVX2 on an AVX-512 machine, as ``peers.py --isa avx2``
does (``benchmarks/isa_avx2.py``; the engine then runs at its pick there, float32).

Batch 1 reads every weight once a token, so it is bound by memory bandwidth, which on a
shared VM drifts by +-15% from minute to minute and from one process's memory to the
next's: compare the median ratio of many rounds, not two single figures.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import isa_avx2
from peers import LLAMA_CPP_BIN, PEERS_DIR, PEERS_HOME

PROMPT_LEN, OUTPUT_LEN = 32, 128


def llama_cpp_decode(tools: Path, gguf: Path, threads: int) -> float | None:
    """``llama-batched-bench`` (in ``tools``) TG tokens/s for one sequence; None when not
    built."""
    binary = tools / "llama-batched-bench"
    if not binary.exists():
        return None
    result = subprocess.run(
        [str(binary), "-m", str(gguf), "-npp", str(PROMPT_LEN), "-ntg", str(OUTPUT_LEN),
         "-npl", "1", "-t", str(threads)], capture_output=True, text=True, timeout=600)
    for line in result.stdout.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 8 and cells[1] == str(PROMPT_LEN):  # | PP | TG | B | N_KV | ... |
            return float(cells[8])  # S_TG t/s
    return None


def engine_decode(model: Path, threads: int, enforce_eager: bool, dtype: str) -> float:
    """The engine's decode tokens/s (this process; see the module docstring)."""
    sys.path.insert(0, str(PEERS_DIR))
    from bench_common import make_prompts  # type: ignore[import-not-found]

    from engine.core import LLM, SamplingParams

    prompt = [{"prompt_token_ids": make_prompts(1, PROMPT_LEN, 8192)[0]}]
    with LLM(str(model), dtype=dtype, max_model_len=2048, num_threads=threads,
             enforce_eager=enforce_eager) as llm:
        def run(tokens: int) -> float:
            start = time.perf_counter()
            llm.generate(prompt, SamplingParams(temperature=0, max_tokens=tokens,
                                                ignore_eos=True), use_tqdm=False)
            return time.perf_counter() - start

        run(8)
        return max((OUTPUT_LEN - 1) / (run(OUTPUT_LEN) - run(1)) for _ in range(7))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--dtype", default="auto", help="the engine's --dtype")
    parser.add_argument("--isa", choices=("native", "avx2"), default="native",
                        help="avx2: both restricted to AVX2, as on a CPU without AVX-512")
    parser.add_argument("--engine-once", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    tools = LLAMA_CPP_BIN
    if args.isa == "avx2":  # the engine's process inherits the restriction
        isa_avx2.apply(PEERS_HOME)
        tools = isa_avx2.build_llama_cpp(PEERS_HOME)
        args.dtype = isa_avx2.engine_dtype(args.dtype)
    model, gguf = PEERS_HOME / "llama-100m", PEERS_HOME / "gguf" / "llama-100m-bf16.gguf"
    if not model.is_dir():
        sys.exit(f"{model} does not exist: run `bash {PEERS_DIR}/setup.sh` first")
    if args.engine_once:
        print(f"ENGINE {engine_decode(model, args.threads, args.enforce_eager, args.dtype):.2f}")
        return
    command = [sys.executable, __file__, "--engine-once", "--threads", str(args.threads),
               "--dtype", args.dtype,
               *(["--enforce-eager"] if args.enforce_eager else [])]
    print(f"batch 1: {PROMPT_LEN} -> {OUTPUT_LEN} tokens, greedy, the engine at {args.dtype}, "
          f"{args.threads} threads, {args.isa} ISA; decode tok/s")
    print(f"{'round':>5s}{'llama.cpp':>11s}{'llama.cpp':>11s}{'engine':>9s}{'engine x':>10s}")
    ratios = []
    for round_ in range(1, args.rounds + 1):
        before = llama_cpp_decode(tools, gguf, args.threads)
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        mine = float(next(line.split()[1] for line in out.splitlines()
                          if line.startswith("ENGINE ")))
        after = llama_cpp_decode(tools, gguf, args.threads)
        if before is None or after is None:
            print(f"{round_:>5d}{'not built':>11s}{'':>11s}{mine:>9.1f}")
            continue
        ratios.append(mine / max(before, after))
        print(f"{round_:>5d}{before:>11.1f}{after:>11.1f}{mine:>9.1f}{ratios[-1]:>10.2f}")
    if ratios:
        print(f"median engine x llama.cpp: {statistics.median(ratios):.2f} "
              f"(min {min(ratios):.2f}, max {max(ratios):.2f}, {len(ratios)} rounds)")


if __name__ == "__main__":
    main()
