"""A Qwen3-MoE and a dense Qwen3: the engine beside transformers, llama.cpp and vLLM.

Two random-initialised checkpoints, built once (seeded) under ``~/.cache/engine-peers``
(``$ENGINE_PEERS``) with the peers' tokenizer (``llama-100m``'s, from
``../shared/peers/setup.sh``):

* ``qwen3-moe-8x768``: Qwen3-MoE, hidden 768, 12 layers, 12/4 heads (head_dim 64), 8
  experts of intermediate 768, top 2, ``norm_topk_prob``, vocab 8192 (~200M parameters,
  ~60M active per token; ``--experts`` / ``--expert-size`` for another);
* ``qwen3-dense-100m``: Qwen3 of the llama-100m size (hidden 768, 12 layers, 12/4 heads,
  intermediate 2560, vocab 8192; ~100M).

Each is converted to a bf16 GGUF for llama.cpp (``../shared/peers/convert_gguf.py``, as
setup.sh converts llama-100m). On the peers' workload (64 prompts x 32 random ids -> 128
new tokens, greedy, EOS ignored, bf16, 2 threads) it runs: the engine (``--dtype``,
default its pick for the CPU), for the MoE model also with the built-in reference
``fused_moe`` (``--custom-ops -fused_moe``: the grouped torch loop, eager) beside
engine-kernels' native call (the default, recorded by the step graph);
transformers ``generate`` (the peers' venv, ``bench_hf.py``); llama.cpp
(``llama-batched-bench`` on the GGUF); vLLM's CPU build (``bench_vllm.py``; a failure to
run the architecture is shown as such). Prints one table with the engine's ratio to each.

    bash ../shared/peers/setup.sh                    # once: the peers and llama-100m
    .venv/bin/python benchmarks/moe.py               # the full workload (minutes per system)
    .venv/bin/python benchmarks/moe.py --quick       # 4 prompts -> 8 tokens: a smoke run
    .venv/bin/python benchmarks/moe.py --systems engine,transformers --models moe
    .venv/bin/python benchmarks/moe.py --isa no-amx  # every system off AMX (a Zen 4's view)
    .venv/bin/python benchmarks/moe.py --isa avx2    # every system on AVX2 only

``--isa`` restricts every system as ``peers.py --isa`` does (``isa_no_amx.py``,
``isa_avx2.py``: the engine's kernels built for that ISA, oneDNN and torch limited, llama.cpp's
AVX2 build for ``avx2``; the engine at its pick for such a CPU).

A peer that is not installed is shown as such, never guessed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import isa_avx2
import isa_no_amx
import peers
from peers import LLAMA_CPP_BIN, PEERS_HOME, cpu_description

#: The peers' scripts: ``../shared/peers`` (peers.py's search), or ``$ENGINE_PEERS_SCRIPTS``
#: (a checkout elsewhere, e.g. a worktree under /tmp).
PEERS_DIR = Path(os.environ.get("ENGINE_PEERS_SCRIPTS", str(peers.PEERS_DIR)))

NUM_PROMPTS, PROMPT_LEN, OUTPUT_LEN = 64, 32, 128
THREADS = 2  # the peers' (bench.sh)
LLAMA_CPP_DIR = LLAMA_CPP_BIN.parents[1]
SYSTEMS = ("engine", "engine-reference", "transformers", "llama.cpp", "vllm")
#: The files of the peers' checkpoint that make its tokenizer (copied beside each model).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "generation_config.json")
#: The peers' environment under ``--isa`` (empty: this process's), and their llama.cpp tools.
PEER_ENV: dict[str, str] = {}
LLAMA_TOOLS = {"bin": LLAMA_CPP_BIN}
#: What a finished build writes last (a half-built directory is rebuilt).
DONE = "moe-benchmark-done.json"


def model_specs(experts: int, expert_size: int) -> dict[str, tuple[str, dict[str, Any]]]:
    """name -> (transformers model type, config) of the two checkpoints."""
    common = {"vocab_size": 8192, "hidden_size": 768, "num_hidden_layers": 12,
              "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64,
              "max_position_embeddings": 2048, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
              "pad_token_id": 3}
    return {
        f"qwen3-moe-{experts}x{expert_size}": ("qwen3_moe", {
            **common, "num_experts": experts, "num_experts_per_tok": 2,
            "moe_intermediate_size": expert_size, "intermediate_size": 2560,
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}),
        "qwen3-dense-100m": ("qwen3", {**common, "intermediate_size": 2560}),
    }


def build_checkpoint(name: str, model_type: str, config: dict[str, Any]) -> Path:
    """The seeded random checkpoint ``PEERS_HOME/name`` (built once) and its bf16 GGUF."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = PEERS_HOME / name
    done = path / DONE
    if not (done.exists() and json.loads(done.read_text()) == config):
        tokenizer = PEERS_HOME / "llama-100m"
        if not (tokenizer / "tokenizer.json").exists():
            sys.exit(f"{tokenizer} does not exist: run `bash {PEERS_DIR}/setup.sh` first")
        shutil.rmtree(path, ignore_errors=True)
        torch.manual_seed(0)
        hf_config = AutoConfig.for_model(model_type, **config)
        model = AutoModelForCausalLM.from_config(hf_config).to(torch.bfloat16).eval()
        model.save_pretrained(path, safe_serialization=True)
        for file in TOKENIZER_FILES:
            if (tokenizer / file).exists():
                shutil.copy(tokenizer / file, path / file)
        params = sum(p.numel() for p in model.parameters())
        print(f"built {path}: {params / 1e6:.0f}M parameters", flush=True)
        done.write_text(json.dumps(config))
    gguf = gguf_path(name)
    if not gguf.exists() or gguf.stat().st_mtime < done.stat().st_mtime:
        python = PEERS_HOME / "venv-hf" / "bin" / "python"
        if python.exists() and LLAMA_CPP_DIR.is_dir():
            gguf.parent.mkdir(parents=True, exist_ok=True)
            result = subprocess.run(
                [str(python), str(PEERS_DIR / "convert_gguf.py"), str(path), "--outtype", "bf16",
                 "--outfile", str(gguf)], capture_output=True, text=True, timeout=1800,
                env={**os.environ, "LLAMA_CPP_DIR": str(LLAMA_CPP_DIR)})
            if result.returncode != 0:
                print(f"{name}: GGUF conversion failed:\n{result.stderr[-2000:]}", flush=True)
                gguf.unlink(missing_ok=True)
    return path


def gguf_path(name: str) -> Path:
    return PEERS_HOME / "gguf" / f"{name}-bf16.gguf"


def make_prompts(num_prompts: int, vocab: int) -> list[list[int]]:
    sys.path.insert(0, str(PEERS_DIR))
    from bench_common import make_prompts as peers_prompts  # type: ignore[import-not-found]

    prompts: list[list[int]] = peers_prompts(num_prompts, PROMPT_LEN, vocab)
    return prompts


def engine_rate(model: Path, num_prompts: int, output_len: int, dtype: str,
                threads: int | None, in_process: bool, **options: Any) -> tuple[float, str]:
    """Generated tokens/s of ``LLM.generate`` (after a 2-prompt warm-up) and how it ran.

    EngineCore in its own process as ``peers.py`` runs it, unless ``in_process`` (then
    whether the step graph recorded the model is known here: "step graph" or "eager").
    """
    from engine.core import LLM, SamplingParams

    prompts = [{"prompt_token_ids": p} for p in make_prompts(num_prompts, 8192)]
    params = SamplingParams(temperature=0, max_tokens=output_len, min_tokens=output_len,
                            ignore_eos=True)
    with LLM(str(model), dtype=dtype, max_model_len=2048, max_num_seqs=256,
             num_threads=threads, in_process=in_process, **options) as llm:
        how = ""
        if in_process:
            runner = llm.llm_engine.core.worker.model_runner
            how = "step graph" if runner.step_graph is not None else "eager"
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed, how


def _peer_rate(command: list[str], pattern: str, env: dict[str, str] | None = None
               ) -> tuple[float | None, str]:
    """Run a peer; its rate (the first group of ``pattern``) or why there is none."""
    try:
        extra = {**PEER_ENV, **(env or {})}
        result = subprocess.run(command, capture_output=True, text=True, timeout=3600,
                                env={**os.environ, **extra} if extra else None)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"failed: {exc}"
    match = re.search(pattern, result.stdout, re.MULTILINE)
    if match:
        return float(match.group(1)), ""
    lines = (result.stderr or result.stdout).strip().splitlines()
    last = next((line for line in reversed(lines) if "Error" in line), lines[-1] if lines else "")
    return None, f"failed: {last.strip()[:100]}"


def transformers_rate(model: Path, num_prompts: int, output_len: int
                      ) -> tuple[float | None, str]:
    python = PEERS_HOME / "venv-hf" / "bin" / "python"
    if not python.exists():
        return None, "not installed"
    return _peer_rate([str(python), str(PEERS_DIR / "bench_hf.py"), "--model", str(model),
                       "--n", str(num_prompts), "--prompt-len", str(PROMPT_LEN), "--out",
                       str(output_len), "--threads", str(THREADS)],
                      r"([0-9.]+) gen tok/s")


def llama_cpp_rate(name: str, num_prompts: int, output_len: int) -> tuple[float | None, str]:
    binary = LLAMA_TOOLS["bin"] / "llama-batched-bench"
    if not binary.exists():
        return None, "not installed"
    if not gguf_path(name).exists():
        return None, "no GGUF (conversion failed)"
    rate, why = _peer_rate(
        [str(binary), "-m", str(gguf_path(name)), "-c", "16384", "-b", "2048", "-ub", "512",
         "-npp", str(PROMPT_LEN), "-ntg", str(output_len), "-npl", str(num_prompts), "-t",
         str(THREADS)],
        rf"^\|\s*{PROMPT_LEN}\s*\|(?:[^|]*\|){{7}}\s*([0-9.]+)\s*\|", )
    # The match is the whole batch's seconds (T s): tokens per second end to end.
    return (None, why) if rate is None else (num_prompts * output_len / rate, "")


def vllm_rate(model: Path, num_prompts: int, output_len: int) -> tuple[float | None, str]:
    python = PEERS_HOME / "venv-vllm" / "bin" / "python"
    if not python.exists():
        return None, "not installed"
    preload = ":".join(p for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                                   str(PEERS_HOME / "venv-vllm" / "lib" / "libiomp5.so"))
                       if Path(p).exists())
    return _peer_rate([str(python), str(PEERS_DIR / "bench_vllm.py"), "--model", str(model),
                       "--n", str(num_prompts), "--prompt-len", str(PROMPT_LEN), "--out",
                       str(output_len)],
                      r"([0-9.]+) gen tok/s",
                      env={"VLLM_CPU_KVCACHE_SPACE": "4", "LD_PRELOAD": preload,
                           "OMP_NUM_THREADS": str(THREADS)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="4 prompts -> 8 tokens: checks that every system runs")
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--output-len", type=int, default=None)
    parser.add_argument("--models", default="moe,dense", help="moe, dense or both")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"a comma-separated subset of {', '.join(SYSTEMS)}")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--expert-size", type=int, default=768)
    parser.add_argument("--dtype", default="auto",
                        help="the engine's --dtype (the peers run bf16); auto: its pick")
    parser.add_argument("--threads", type=int, default=None,
                        help="the engine's --num-threads (default: its own choice)")
    parser.add_argument("--in-process", action="store_true",
                        help="EngineCore in this process (the table then says whether the "
                             "step graph recorded each engine run)")
    parser.add_argument("--isa", choices=("native", "avx2", "no-amx"), default="native",
                        help="native: as the CPU is; avx2: every system restricted to AVX2 "
                             "(benchmarks/isa_avx2.py); no-amx: every system kept off AMX "
                             "(benchmarks/isa_no_amx.py)")
    args = parser.parse_args()
    if args.isa == "avx2":
        PEER_ENV.update(isa_avx2.apply(PEERS_HOME))
        home = Path(PEER_ENV["ENGINE_PEERS"])  # llama.cpp's AVX2 build linked in
        LLAMA_TOOLS["bin"] = home / isa_avx2.LLAMA_CPP_SRC / "build" / "bin"
        args.dtype = isa_avx2.engine_dtype(args.dtype)
    elif args.isa == "no-amx":
        PEER_ENV.update(isa_no_amx.apply(PEERS_HOME))
    num_prompts = args.num_prompts or (4 if args.quick else NUM_PROMPTS)
    output_len = args.output_len or (8 if args.quick else OUTPUT_LEN)
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        sys.exit(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    specs = model_specs(args.experts, args.expert_size)
    wanted = [name for name in specs
              if name.split("-")[1] in args.models.split(",")]
    results: dict[str, dict[str, tuple[float | None, str]]] = {}
    for name in wanted:
        model_type, config = specs[name]
        path = build_checkpoint(name, model_type, config)
        row = results.setdefault(name, {})
        for system in systems:
            if system == "engine-reference" and model_type != "qwen3_moe":
                continue
            print(f"{name}: {system} ...", flush=True)
            if system == "engine":
                rate, how = engine_rate(path, num_prompts, output_len, args.dtype, args.threads,
                                        args.in_process)
                row[system] = (rate, how)
            elif system == "engine-reference":
                rate, how = engine_rate(path, num_prompts, output_len, args.dtype, args.threads,
                                        args.in_process, custom_ops=["-fused_moe"])
                row[system] = (rate, how)
            elif system == "transformers":
                row[system] = transformers_rate(path, num_prompts, output_len)
            elif system == "llama.cpp":
                row[system] = llama_cpp_rate(name, num_prompts, output_len)
            else:
                row[system] = vllm_rate(path, num_prompts, output_len)
    print_table(results, systems, num_prompts, output_len, args)


def print_table(results: dict[str, dict[str, tuple[float | None, str]]], systems: list[str],
                num_prompts: int, output_len: int, args: argparse.Namespace) -> None:
    cpu, has = cpu_description()
    dtype = args.dtype
    if dtype == "auto":
        from engine.core.platforms._builtin import CpuPlatform
        dtype = f"auto = {CpuPlatform.supported_dtypes()[0]}"
    limit = {"avx2": "every system restricted to AVX2 (--isa avx2) on ",
             "no-amx": "every system kept off AMX (--isa no-amx) on "}.get(args.isa, "")
    print(f"\n{num_prompts} prompts x {PROMPT_LEN} -> {output_len} tokens, greedy, peers bf16 "
          f"on {THREADS} threads, engine {dtype}; {limit}{cpu} ({', '.join(has)})")
    names = list(results)
    print("engine-reference: the engine with the built-in fused_moe (--custom-ops "
          "-fused_moe); its 'engine x' is engine-kernels' native call's speed-up")
    print(f"{'system':18s}" + "".join(f"{name:>28s}{'engine x':>10s}" for name in names))
    for system in systems:
        line = f"{system:18s}"
        if not any(system in results[name] for name in names):
            continue
        for name in names:
            rate, note = results[name].get(system, (None, "-"))
            own = results[name].get("engine", (None, ""))[0]
            if rate is None:
                line += f"{note[:28]:>28s}{'':>10s}"
                continue
            ratio = f"{own / rate:.2f}" if own and system != "engine" else ""
            cell = f"{rate:.1f}" + (f" ({note})" if note else "")
            line += f"{cell[-28:]:>28s}{ratio:>10s}"
        print(line)


if __name__ == "__main__":
    main()
