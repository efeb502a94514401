"""Offline throughput on a quiet machine and with one core kept busy, for the engine and peers.

Each system runs ``peers.py``'s offline workload (``--num-prompts`` prompts x 32 random
token ids -> 128 new tokens, greedy, EOS ignored, on ``llama-100m``; fewer prompts than
``peers.py``'s 64 by default, to keep the contended runs of the slow peers short) once
quiet and once per busy CPU while another process spins there (pinned with
``os.sched_setaffinity``): by default each CPU of this process in turn, because a system
that pins its threads (vLLM binds its one model thread to CPU 0 and keeps the last CPU for
its scheduler on a 2-core machine) loses a different share depending on which core the
neighbour takes. Rounds run the systems in turns, quiet and contended interleaved, so a
neighbour's load drifting during the run lands on both sides. Every run is a fresh
process, killed with its spinner.

    bash ../shared/peers/setup.sh                                  # once: peers + checkpoint
    .venv/bin/python benchmarks/contention.py                      # engine and every peer
    .venv/bin/python benchmarks/contention.py --systems engine --rounds 3
    # the engine as it was before its threads yielded, beside its default
    .venv/bin/python benchmarks/contention.py --systems engine \\
        --engine "spinning:GOMP_SPINCOUNT=300000"

``--engine NAME:VAR=VALUE,...`` adds an engine row run with those environment variables
(e.g. an operator's own ``OMP_WAIT_POLICY``); ``--engine NAME:`` is the default engine under
another name. Prints one table: each system's quiet tok/s and its tok/s with each CPU
busy, per round, and the share of its quiet throughput it kept with the worse of the busy
CPUs (median over rounds).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import peers

HERE = Path(__file__).resolve().parent
#: vLLM's environment as ``bench.sh`` runs it (its ``vllm_env``).
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4",
            "LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:"
                          f"{peers.PEERS_HOME}/venv-vllm/lib/libiomp5.so"}
SPINNER = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"
RUN_TIMEOUT_S = 1800


def spin_on(cpu: int) -> subprocess.Popen[bytes]:
    """A process that keeps ``cpu`` busy until killed."""
    return subprocess.Popen([sys.executable, "-c", SPINNER, str(cpu)])


def _rate(command: list[str], env: dict[str, str], pattern: str) -> float | None:
    """Run ``command``; the first group of ``pattern`` in its output, as tok/s."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                            env={**os.environ, **env})
    match = re.search(pattern, result.stdout)
    if match is None:
        print(f"  {command[0]} ... gave no figure (exit {result.returncode}): "
              f"{result.stderr.strip()[-400:]}", file=sys.stderr)
        return None
    return float(match.group(1))


def engine_command(args: argparse.Namespace) -> list[str]:
    command = [sys.executable, str(HERE / "contention.py"), "--engine-once",
               "--num-prompts", str(args.num_prompts), "--dtype", args.dtype]
    return command + (["--threads", str(args.threads)] if args.threads else [])


def run_system(name: str, env: dict[str, str], args: argparse.Namespace) -> float | None:
    """One run of ``name`` (``engine...``, ``llama.cpp``, ``vllm``, ``transformers``)."""
    model, n, threads = peers.PEERS_HOME / args.model, str(args.num_prompts), args.threads or 2
    common = ["--model", str(model), "--n", n, "--prompt-len", str(peers.PROMPT_LEN),
              "--out", str(peers.OUTPUT_LEN)]
    if name.startswith("engine"):
        return _rate(engine_command(args), env, r"^ENGINE ([0-9.]+)")
    if name == "llama.cpp":
        gguf = peers.PEERS_HOME / "gguf" / f"{args.model}-bf16.gguf"
        return peers.llama_cpp_offline(gguf, threads, args.num_prompts)
    if name == "vllm":
        python = peers.PEERS_HOME / "venv-vllm" / "bin" / "python"
        return _rate([str(python), str(peers.PEERS_DIR / "bench_vllm.py"), *common],
                     VLLM_ENV, r"([0-9.]+) gen tok/s")
    python = peers.PEERS_HOME / "venv-hf" / "bin" / "python"
    return _rate([str(python), str(peers.PEERS_DIR / "bench_hf.py"), *common, "--threads",
                  str(threads)], {}, r"([0-9.]+) gen tok/s")


def installed(name: str, args: argparse.Namespace) -> bool:
    """Whether setup.sh built ``name``."""
    home = peers.PEERS_HOME
    return {"llama.cpp": (peers.LLAMA_CPP_BIN / "llama-batched-bench").exists(),
            "vllm": (home / "venv-vllm" / "bin" / "python").exists(),
            "transformers": (home / "venv-hf" / "bin" / "python").exists()
            }.get(name, (home / args.model).is_dir())


def measure(name: str, env: dict[str, str], args: argparse.Namespace,
            busy_cpu: int | None) -> float | None:
    """One run of ``name``, with ``busy_cpu`` kept busy by another process (None: quiet)."""
    spinner = None if busy_cpu is None else spin_on(busy_cpu)
    try:
        if spinner is not None:
            time.sleep(0.5)  # let it settle on its CPU
        return run_system(name, env, args)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()


def parse_engines(items: list[str]) -> dict[str, dict[str, str]]:
    """``--engine NAME:VAR=VALUE,...`` -> {"engine (NAME)": {VAR: VALUE}}."""
    engines: dict[str, dict[str, str]] = {}
    for item in items:
        name, _, assignments = item.partition(":")
        env = dict(a.split("=", 1) for a in assignments.split(",") if "=" in a)
        engines[f"engine ({name})"] = env
    return engines


Runs = dict[int | None, float | None]  # busy CPU (None: quiet) -> tok/s


def table(results: dict[str, list[Runs]], busy_cpus: list[int]) -> None:
    def cell(runs: list[Runs], key: int | None) -> str:
        return " / ".join("-" if r[key] is None else f"{r[key]:.1f}" for r in runs)
    header = f"{'system':20s}{'quiet tok/s':>22s}"
    header += "".join(f"{f'CPU {cpu} busy':>22s}" for cpu in busy_cpus)
    print(header + f"{'kept':>7s}")
    for name, runs in results.items():
        kept = []
        for r in runs:
            shares = [r[c] / r[None] for c in busy_cpus if r[None] and r[c] is not None]
            if len(shares) == len(busy_cpus):
                kept.append(min(shares))
        line = f"{name:20s}{cell(runs, None):>22s}"
        line += "".join(f"{cell(runs, cpu):>22s}" for cpu in busy_cpus)
        print(line + f"{f'{statistics.median(kept):.0%}' if kept else '-':>7s}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama-100m")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--systems", default="engine,llama.cpp,vllm,transformers",
                        help="comma-separated: engine, llama.cpp, vllm, transformers")
    parser.add_argument("--engine", action="append", default=[], metavar="NAME:VAR=VALUE,...",
                        help="another engine row, run with these environment variables")
    parser.add_argument("--threads", type=int, default=None,
                        help="the engine's --num-threads (default: its own choice) and the "
                             "peers' threads (default 2, as bench.sh)")
    parser.add_argument("--dtype", default="auto", help="the engine's --dtype")
    parser.add_argument("--busy-cpu", type=int, action="append", default=[],
                        help="a CPU the spinning process is pinned to (repeatable; default: "
                             "each CPU this process may use, in turn)")
    parser.add_argument("--engine-once", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine_once:  # one engine run in this fresh process
        rate = peers.engine_offline(peers.PEERS_HOME / args.model, args.threads,
                                    dtype=args.dtype, num_prompts=args.num_prompts)
        print(f"ENGINE {rate:.1f}")
        return
    systems = {name: {} for name in args.systems.split(",") if name}
    systems.update(parse_engines(args.engine))
    missing = [name for name in systems if not installed(name, args)]
    for name in missing:
        print(f"{name}: not installed (run bash {peers.PEERS_DIR}/setup.sh)", file=sys.stderr)
        del systems[name]
    busy_cpus = args.busy_cpu or sorted(os.sched_getaffinity(0))
    results: dict[str, list[Runs]] = {n: [] for n in systems}
    for round_index in range(args.rounds):
        for name, env in systems.items():
            runs: Runs = {None: measure(name, env, args, None)}
            for cpu in busy_cpus:
                runs[cpu] = measure(name, env, args, cpu)
            print(f"round {round_index + 1} {name}: " + ", ".join(
                f"{'quiet' if k is None else f'CPU {k} busy'} {v}" for k, v in runs.items()),
                flush=True)
            results[name].append(runs)
    cpu, flags = peers.cpu_description()
    print(f"\n{args.model}: {args.num_prompts} prompts x {peers.PROMPT_LEN} -> "
          f"{peers.OUTPUT_LEN} tokens, greedy; {len(os.sched_getaffinity(0))} CPUs, "
          f"CPU N busy: another process spins there; {cpu} ({', '.join(flags)}); per round; "
          f"kept: the median over rounds of the lower busy / quiet")
    table(results, busy_cpus)
    for name in missing:
        print(f"{name:20s}{'not installed':>22s}")


if __name__ == "__main__":
    main()
