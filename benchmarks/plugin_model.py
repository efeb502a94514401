"""A model plugin against the built-in Llama of the same size: offline throughput of each.

The plugin is engine-test-plugin-capture's ``Qwen3ForCausalLM`` (built only through
``ctx.layers`` and the SDK; it declares that a graph may record its pass), pip-installed
into a temporary directory and chosen with ``--model-impl`` (engine-core has a Qwen3 of its
own); the built-in is ``LlamaForCausalLM``. Both random-initialised with the throughput
benchmark's sizes (hidden 768, 12 layers, 12 heads, 4 KV heads, intermediate 2560, vocab
8192; Qwen3's head_dim 64 = hidden / heads), same workload
(64 prompts x 32 -> 128, greedy, EOS ignored), with the step graph and with
``--enforce-eager``. Every engine is started once (EngineCore in its own process, as
``LLM`` does by default) and the runs alternate between them ``--rounds`` times, so a
busy machine slows them alike; the best and the median round of each are printed, and
the ratio of each round's two runs (run one after the other).

    .venv/bin/python benchmarks/plugin_model.py                 # bfloat16, 5 rounds
    .venv/bin/python benchmarks/plugin_model.py --dtype float32 --rounds 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from throughput import DTYPES, random_prompts


def build_qwen3(path: Path) -> Path:
    """A random Qwen3 checkpoint with the benchmark Llama's sizes (head_dim 768 / 12)."""
    from engine.testing.models import BENCH_LLAMA_100M, build_tiny_checkpoint

    return build_tiny_checkpoint(path, "qwen3", **BENCH_LLAMA_100M, head_dim=64)


def timed(llm: Any, prompts: list[list[int]], output_len: int) -> float:
    """Generated tokens per second of one run of the workload."""
    from engine.core import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-eager", action="store_true")
    args = parser.parse_args()
    from engine.core import LLM, SamplingParams
    from engine.testing.models import BENCH_LLAMA_100M, build_random_llama
    from engine.testing.test_plugins import install_test_plugins

    with tempfile.TemporaryDirectory() as tmp:
        site = install_test_plugins(Path(tmp) / "site", ("capture",))
        sys.path.insert(0, str(site))  # this process, and EngineCore's (PYTHONPATH)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
        models = {"llama": build_random_llama(Path(tmp) / "llama", BENCH_LLAMA_100M),
                  "qwen3": build_qwen3(Path(tmp) / "qwen3")}
        prompts = random_prompts(args.num_prompts, args.input_len,
                                 BENCH_LLAMA_100M["vocab_size"], args.seed)
        modes = ["graph"] if args.skip_eager else ["graph", "eager"]
        engines = {}
        for mode in modes:
            for name, path in models.items():
                # The plugin's Qwen3, not engine-core's own (auto picks it too).
                impl = "engine-test-plugin-capture" if name == "qwen3" else "auto"
                llm = LLM(str(path), dtype=args.dtype, num_threads=args.threads,
                          max_model_len=args.input_len + args.output_len + 16,
                          max_num_seqs=args.num_prompts, enforce_eager=mode == "eager",
                          model_impl=impl)
                llm.generate([{"prompt_token_ids": p} for p in prompts[:4]],  # warm-up
                             SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                             use_tqdm=False)
                engines[(name, mode)] = llm
        runs: dict[tuple[str, str], list[float]] = {key: [] for key in engines}
        for round_ in range(args.rounds):
            for key, llm in engines.items():
                runs[key].append(timed(llm, prompts, args.output_len))
                print(f"round {round_ + 1}: {key[0]:<6} {key[1]:<6} {runs[key][-1]:8.1f} tok/s",
                      flush=True)
        for llm in engines.values():
            llm.shutdown()
    print(f"\nworkload: {args.num_prompts} prompts x {args.input_len} tokens -> "
          f"{args.output_len} new tokens, greedy, EOS ignored, {args.dtype}; "
          f"{args.rounds} alternated rounds")
    for mode in modes:
        for pick, how in ((max, "best"), (statistics.median, "median")):
            llama, qwen3 = pick(runs[("llama", mode)]), pick(runs[("qwen3", mode)])
            print(f"{mode:<6} {how:<7} llama (built-in) {llama:8.1f}  qwen3 (plugin) "
                  f"{qwen3:8.1f}  ratio {qwen3 / llama:.3f}")
        pairs = [q / max(lm, 1e-9) for q, lm in zip(runs[("qwen3", mode)],
                                                  runs[("llama", mode)], strict=True)]
        print(f"{mode:<6} per-round ratios (runs side by side) "
              f"{', '.join(f'{r:.3f}' for r in pairs)}; median {statistics.median(pairs):.3f}")


if __name__ == "__main__":
    main()
