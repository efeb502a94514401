"""A model plugin against the built-in Llama of the same size: offline throughput of each.

The plugin is engine-test-plugin-capture's ``Qwen3ForCausalLM`` (built only through
``ctx.layers`` and the SDK; it declares that a graph may record its pass), pip-installed
into a temporary directory; the built-in is ``LlamaForCausalLM``. Both random-initialised
with the throughput benchmark's sizes (hidden 768, 12 layers, 12 heads, 4 KV heads,
intermediate 2560, vocab 8192; Qwen3's head_dim 64 = hidden / heads), same workload
(64 prompts x 32 -> 128, greedy, EOS ignored), alternated ``--rounds`` times, with the
step graph and with ``--enforce-eager``.

    .venv/bin/python benchmarks/plugin_model.py                 # bfloat16, 3 rounds
    .venv/bin/python benchmarks/plugin_model.py --dtype float32 --rounds 5

Prints each run, then the median tok/s of each model and mode and the plugin's ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from throughput import DTYPES, random_prompts, run_engine


def build_qwen3(path: Path) -> Path:
    """A random Qwen3 checkpoint with the benchmark Llama's sizes (head_dim 768 / 12)."""
    from engine.testing.models import BENCH_LLAMA_100M, build_tiny_checkpoint

    return build_tiny_checkpoint(path, "qwen3", **BENCH_LLAMA_100M, head_dim=64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-eager", action="store_true")
    args = parser.parse_args()
    args.tensor_parallel_size, args.distributed_executor_backend = 1, None
    args.in_process = args.profile = False
    from engine.testing.models import BENCH_LLAMA_100M, build_random_llama
    from engine.testing.test_plugins import install_test_plugins

    with tempfile.TemporaryDirectory() as tmp:
        site = install_test_plugins(Path(tmp) / "site", ("capture",))
        sys.path.insert(0, str(site))  # this process, and EngineCore's (PYTHONPATH)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
        models = {"llama (built-in)": str(build_random_llama(Path(tmp) / "llama",
                                                             BENCH_LLAMA_100M)),
                  "qwen3 (plugin)": str(build_qwen3(Path(tmp) / "qwen3"))}
        prompts = random_prompts(args.num_prompts, args.input_len,
                                 BENCH_LLAMA_100M["vocab_size"], args.seed)
        modes = {"graph": {}} if args.skip_eager else {"graph": {}, "eager": {
            "enforce_eager": True}}
        runs: dict[tuple[str, str], list[float]] = {}
        for round_ in range(args.rounds):
            for mode, options in modes.items():
                for name, path in models.items():
                    tps = run_engine(path, prompts, args, **options)
                    runs.setdefault((name, mode), []).append(tps)
                    print(f"round {round_ + 1}: {name:<17} {mode:<6} {tps:8.1f} tok/s",
                          flush=True)
    print(f"\nworkload: {args.num_prompts} prompts x {args.input_len} tokens -> "
          f"{args.output_len} new tokens, greedy, EOS ignored, {args.dtype}; median of "
          f"{args.rounds} alternated rounds")
    for mode in modes:
        llama = statistics.median(runs[("llama (built-in)", mode)])
        qwen3 = statistics.median(runs[("qwen3 (plugin)", mode)])
        print(f"{mode:<6} llama {llama:8.1f}  qwen3 plugin {qwen3:8.1f}  ratio "
              f"{qwen3 / llama:.3f}")


if __name__ == "__main__":
    main()
