"""Per-token cost of structured outputs: a batch of JSON-schema requests vs unconstrained.

Workload: 64 prompts x 32 random token ids -> 64 new tokens, greedy, EOS ignored, bfloat16,
2 threads, EngineCore in this process (``uni`` executor), on the random ~102M Llama of
``throughput.py`` (vocab 8192, byte-level tokenizer; built once and cached) and, with
``--model default``, on the default model (SmolLM2-135M GGUF, vocab 49152). Three batches:
no constraint, all 64 constrained by one JSON schema (compiled once, in the warm-up), and
32 + 32 interleaved.

    .venv/bin/python benchmarks/structured_outputs.py                   # random model
    .venv/bin/python benchmarks/structured_outputs.py --model random --model default

The schema's shortest valid output is longer than 64 tokens, so every request generates
all 64 and the batches stay comparable. The extra time of a constrained step is split by
wrapping the calls in this script (``time.perf_counter`` around them; engine code is not
edited): the bitmask fill in EngineCore (``StructuredOutputManager.grammar_bitmask``:
allocation and ``backend.fill_bitmask``), the matchers' advance (``accept``) and the mask
applied to the logits in the worker (``apply_grammar_bitmask``). "wall extra" is the
difference of whole runs, and on a shared machine as noisy as they are (a few percent);
the measured columns are not. Each batch runs ``--repeats`` times, interleaved; the fastest
run is shown. Prints the CPU line, then one markdown table per model.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

CACHE = Path(os.environ.get("ENGINE_BENCH_CACHE", Path.home() / ".cache" / "engine-bench"))

#: 20+ items of ~6 tokens or more each: no valid output fits in 64 tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array", "minItems": 20,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "name": {"type": "string"},
                    "kind": {"enum": ["book", "film", "game"]},
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["id", "name", "kind", "tags"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["items"],
    "additionalProperties": False,
}


def cpu_line() -> str:
    """``lscpu``'s model name and cores, and whether the CPU has avx512_bf16."""
    name, flags = "unknown", set[str]()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and name == "unknown":
                    name = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")
    return (f"CPU: {name}, {len(os.sched_getaffinity(0))} cores; avx512_bf16: "
            f"{'yes' if 'avx512_bf16' in flags else 'no'}; flags: "
            f"{' '.join(f for f in wanted if f in flags) or 'none of ' + ', '.join(wanted)}; "
            f"torch {torch.__version__}")


def random_checkpoint() -> Path:
    """``throughput.py``'s random Llama, built once under ``$ENGINE_BENCH_CACHE``."""
    from engine.testing.models import BENCH_LLAMA_100M, build_random_llama

    path = CACHE / "llama-100m"
    if not (path / "model.safetensors").is_file():
        build_random_llama(path, BENCH_LLAMA_100M)
    return path


class Timers:
    """Seconds spent in each wrapped call, and how many forward passes ran."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
        return timed

    def reset(self) -> None:
        self.seconds.clear()
        self.steps = 0


def instrument(llm: Any, timers: Timers) -> None:
    """Time the structured-output calls of ``llm``'s in-process EngineCore and its worker."""
    import engine.core.worker.model_runner as model_runner

    core = llm.llm_engine.core
    manager = core.structured_output
    manager.grammar_bitmask = timers.wrap("fill", manager.grammar_bitmask)
    manager.accept = timers.wrap("accept", manager.accept)
    # The worker's module imported the function by name: replace it there.
    apply = timers.wrap("apply", getattr(model_runner, "apply_grammar_bitmask"))  # noqa: B009
    setattr(model_runner, "apply_grammar_bitmask", apply)  # noqa: B010
    execute = core.executor.execute_model

    def counted(*args: Any, **kwargs: Any) -> Any:
        timers.steps += 1
        return execute(*args, **kwargs)

    core.executor.execute_model = counted


def run_batch(llm: Any, prompts: list[list[int]], constrained: list[bool], output_len: int,
              timers: Timers) -> dict[str, float]:
    from engine.core import SamplingParams
    from engine.sdk.structured_output import StructuredOutputsParams

    plain = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    schema = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    params = [schema if c else plain for c in constrained]
    timers.reset()
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    failed = [o.outputs[0].error for o in outputs if o.outputs[0].finish_reason == "error"]
    assert not failed, failed[0]
    assert generated == len(prompts) * output_len, (generated, "a request stopped early")
    return {"elapsed": elapsed, "tok_s": generated / elapsed, "steps": timers.steps,
            **{k: v for k, v in timers.seconds.items()}}


def bench_model(name: str, args: argparse.Namespace) -> list[tuple[str, dict[str, float]]]:
    from engine.core import LLM, SamplingParams
    from engine.sdk.structured_output import StructuredOutputsParams

    if name == "random":
        model: str | None = str(random_checkpoint())
        vocab = 8192
    else:
        model, vocab = (None, 49152) if name == "default" else (name, 32000)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(3, vocab, (args.num_prompts, args.input_len), generator=gen).tolist()
    timers = Timers()
    batches = {"unconstrained": [False] * args.num_prompts,
               f"{args.num_prompts} JSON-schema": [True] * args.num_prompts,
               "half / half": [i % 2 == 0 for i in range(args.num_prompts)]}
    results: dict[str, dict[str, float]] = {}
    with LLM(model, dtype=args.dtype, in_process=True, num_threads=args.threads,
             max_model_len=args.input_len + args.output_len + 16,
             max_num_seqs=args.num_prompts) as llm:
        instrument(llm, timers)
        # Warm-up: the schema's grammar is compiled (and cached) here, not in the timed runs.
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], SamplingParams(
            temperature=0, max_tokens=4, ignore_eos=True,
            structured_outputs=StructuredOutputsParams(json=SCHEMA)),
            use_tqdm=False)
        print(f"{name}: warm-up with the first compile {time.perf_counter() - start:.2f} s")
        for _ in range(args.repeats):
            for label, constrained in batches.items():
                run = run_batch(llm, prompts, constrained, args.output_len, timers)
                if label not in results or run["elapsed"] < results[label]["elapsed"]:
                    results[label] = run
    return list(results.items())


def print_table(name: str, rows: list[tuple[str, dict[str, float]]]) -> None:
    base = rows[0][1]
    base_ms = base["elapsed"] * 1e3 / base["steps"]
    print(f"\n{name}:\n")
    print("| batch | tok/s | steps | ms/step | wall extra ms/step | fill (EngineCore) "
          "| accept (EngineCore) | mask apply (worker) | measured sum |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, run in rows:
        steps = run["steps"]
        ms = run["elapsed"] * 1e3 / steps
        if label == rows[0][0]:
            print(f"| {label} | {run['tok_s']:.1f} | {steps} | {ms:.2f} | | | | | |")
            continue
        parts = [run.get(k, 0.0) * 1e3 / steps for k in ("fill", "accept", "apply")]
        extra = ms - base_ms
        print(f"| {label} | {run['tok_s']:.1f} | {steps} | {ms:.2f} | {extra:+.2f} "
              f"({extra / base_ms:+.1%}) | {parts[0]:.2f} | {parts[1]:.2f} | {parts[2]:.2f} "
              f"| {sum(parts):.2f} ({sum(parts) / base_ms:.1%}) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", action="append",
                        help="random, default, or a path (repeatable; default: random)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_line())
    tables = [(name, bench_model(name, args)) for name in args.model or ["random"]]
    print(f"\nworkload: {args.num_prompts} prompts x {args.input_len} tokens -> "
          f"{args.output_len} new tokens, greedy, EOS ignored, {args.dtype}, {args.threads} "
          f"threads, EngineCore in process (uni); ms per forward pass; the split columns are "
          f"ms per step spent in each call; best of {args.repeats}")
    for name, rows in tables:
        print_table(name, rows)


if __name__ == "__main__":
    main()
