"""Memory under a soak: RSS of both ``engine serve`` processes, minute by minute.

Starts a real ``engine serve`` (EngineCore in its own process) and keeps ``--concurrency``
streaming clients busy for ``--minutes``, with traffic that churns the KV cache and the
prefix cache the way real traffic does: prompt lengths from 1 token to most of the context,
some prompts sharing one of a few prefixes, ``max_tokens`` from 1 to ``--max-tokens``,
greedy and seeded random sampling, completions (token ids) and chat (text through the
template and the tokenizer). Every ``--interval`` seconds it prints one row: the API
server's and EngineCore's RSS, EngineCore's ``[heap]`` (the main malloc arena, from
``/proc/PID/smaps``), the requests finished, the output tokens/s of the interval and
EngineCore's CPU time per output token in it.

    .venv/bin/python benchmarks/soak.py                       # 30 minutes, tiny Llama, 8 streams
    .venv/bin/python benchmarks/soak.py --minutes 5 --interval 30
    ONEDNN_PRIMITIVE_CACHE_CAPACITY=1024 .venv/bin/python benchmarks/soak.py  # env: both processes
    .venv/bin/python benchmarks/soak.py --model random --max-num-seqs 8   # + `engine serve` flags

``--model tiny`` (default) is the test suite's tiny random Llama (hidden 64, 2 layers,
vocab 512, 256 positions), built in a temporary directory; ``random`` is the ~102M random
Llama of the other benchmarks; anything else is a checkpoint path. Flags this script does
not know go to ``engine serve``. The last line says how much each process grew over the
second half of the run (after the warm-up half): the figure that must stay near zero.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

MB = 1024 * 1024


@dataclass
class Counters:
    """What the clients have done so far (shared by all client tasks)."""

    requests: int = 0
    tokens: int = 0
    errors: int = 0
    last_error: str = ""


@dataclass
class Workload:
    """The shape of the traffic."""

    vocab_size: int
    max_model_len: int
    max_tokens: int
    prefixes: list[list[int]] = field(default_factory=list)


def rss_mb(pid: int) -> float:
    """Resident set size of ``pid`` in MiB (0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def heap_mb(pid: int) -> float:
    """Resident MiB of the ``[heap]`` mapping of ``pid`` (the main malloc arena)."""
    in_heap = False
    try:
        for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
            first = line.split(maxsplit=1)[0]
            if not first.endswith(":"):  # a mapping's header line
                in_heap = line.rstrip().endswith("[heap]")
            elif in_heap and first == "Rss:":
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds ``pid`` has used (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def make_request(rng: random.Random, work: Workload) -> tuple[str, dict]:
    """One request's endpoint and body: varied lengths, prefixes, sampling and kinds."""
    max_tokens = rng.randint(1, work.max_tokens)
    room = work.max_model_len - max_tokens
    sampling = ({"temperature": 0.0} if rng.random() < 0.5 else
                {"temperature": 0.9, "top_p": 0.9, "seed": rng.randrange(2 ** 31)})
    kind = rng.random()
    if kind < 0.2:  # chat: text through the chat template and the tokenizer
        words = " ".join(rng.choice(("soak", "memory", "steady", "cache", "token", "heap"))
                         for _ in range(rng.randint(1, max(1, room // 12))))
        body = {"messages": [{"role": "user", "content": words}]}
        return "chat", {**body, "max_tokens": max_tokens, **sampling}
    length = rng.randint(1, max(1, room - 40))
    if kind < 0.6 and work.prefixes:  # shared prefix + own suffix: prefix-cache hits
        prefix = rng.choice(work.prefixes)
        length = max(1, min(length, room - len(prefix)))
        prompt = prefix + [rng.randrange(3, work.vocab_size) for _ in range(length)]
    else:
        prompt = [rng.randrange(3, work.vocab_size) for _ in range(length)]
    return "completions", {"prompt": prompt[:room], "max_tokens": max_tokens, **sampling}


async def client_loop(client, model: str, work: Workload, seed: int, deadline: float,
                      counters: Counters) -> None:
    """Send streaming requests back to back until ``deadline``."""
    import openai

    rng = random.Random(seed)
    while time.monotonic() < deadline:
        kind, body = make_request(rng, work)
        create = (client.chat.completions.create if kind == "chat"
                  else client.completions.create)
        tokens = 0
        try:
            stream = await create(model=model, stream=True,
                                  stream_options={"include_usage": True},
                                  extra_body={"ignore_eos": rng.random() < 0.7}, **body)
            async for chunk in stream:
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
        except openai.APIError as exc:  # counted and shown: a soak goes on after one
            counters.errors += 1
            counters.last_error = f"{type(exc).__name__}: {exc}"[:200]
            continue
        counters.requests += 1
        counters.tokens += tokens


async def soak(server, work: Workload, args: argparse.Namespace) -> list[tuple]:
    """Drive the server for ``args.minutes``; print and return one row per interval."""
    engine_pids = server.engine_core_pids()
    engine_pid = engine_pids[0] if engine_pids else server.process.pid
    client = server.async_client(timeout=600)
    counters = Counters()
    start = time.monotonic()
    deadline = start + 60 * args.minutes
    clients = [asyncio.create_task(client_loop(client, server.model, work, seed, deadline,
                                               counters))
               for seed in range(args.concurrency)]
    print(f"server pid {server.process.pid}, EngineCore pid {engine_pid}; "
          f"{args.concurrency} streams for {args.minutes} min")
    print(f"{'minute':>6} {'server MB':>9} {'core MB':>8} {'core heap':>9} "
          f"{'requests':>8} {'tok/s':>7} {'core CPU ms/tok':>15} {'errors':>6}", flush=True)
    rows = []
    last_tokens, last_time, last_cpu = 0, start, cpu_seconds(engine_pid)
    next_sample = start
    while True:
        now, cpu = time.monotonic(), cpu_seconds(engine_pid)
        new_tokens = counters.tokens - last_tokens
        tps = new_tokens / max(now - last_time, 1e-9)
        cpu_per_token = 1000 * (cpu - last_cpu) / new_tokens if new_tokens else float("nan")
        last_tokens, last_time, last_cpu = counters.tokens, now, cpu
        row = ((now - start) / 60, rss_mb(server.process.pid), rss_mb(engine_pid),
               heap_mb(engine_pid), counters.requests, tps, cpu_per_token, counters.errors)
        rows.append(row)
        print(f"{row[0]:6.1f} {row[1]:9.1f} {row[2]:8.1f} {row[3]:9.1f} {row[4]:8d} "
              f"{row[5]:7.1f} {row[6]:15.2f} {row[7]:6d}", flush=True)
        if now >= deadline or server.process.poll() is not None:
            break
        next_sample += args.interval
        await asyncio.sleep(max(0.0, min(next_sample, deadline) - time.monotonic()))
    await asyncio.gather(*clients)
    await client.close()
    if counters.errors:
        print(f"{counters.errors} requests failed; the last: {counters.last_error}")
    return rows


def summary(rows: list[tuple]) -> str:
    """Growth of each process over the second half of the run, in MiB per 10 minutes."""
    half = [r for r in rows if r[0] >= rows[-1][0] / 2]
    if len(half) < 2 or half[-1][0] == half[0][0]:
        return "too short a run for a growth figure"
    span = half[-1][0] - half[0][0]
    server, core = ((half[-1][i] - half[0][i]) * 10 / span for i in (1, 2))
    return (f"second half ({half[0][0]:.1f}-{half[-1][0]:.1f} min): server "
            f"{half[0][1]:.0f} -> {half[-1][1]:.0f} MB ({server:+.1f} MB/10 min), EngineCore "
            f"{half[0][2]:.0f} -> {half[-1][2]:.0f} MB ({core:+.1f} MB/10 min)")


def checkpoint_limits(path: Path) -> tuple[int, int]:
    """``(vocab size, context)`` of a Hugging Face checkpoint (context capped at 1024)."""
    import json

    config = path / "config.json"
    if not config.is_file():  # a GGUF file: ids below 256 exist in every vocabulary
        return 256, 1024
    values = json.loads(config.read_text())
    return values["vocab_size"], min(1024, values.get("max_position_embeddings", 1024))


def main() -> None:
    from engine.testing.models import TINY_LLAMA, build_tiny_checkpoint
    from engine.testing.server import start_server

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", help="tiny, random, or a checkpoint path")
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="each request asks for 1..this many tokens")
    parser.add_argument("--interval", type=float, default=60.0,
                        help="seconds between rows (default: a minute)")
    parser.add_argument("--dtype", default="float32")
    args, server_args = parser.parse_known_args()  # the rest goes to `engine serve`
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "tiny":
            model = str(build_tiny_checkpoint(Path(tmp) / "tiny-llama", "llama"))
            vocab, max_len = TINY_LLAMA["vocab_size"], TINY_LLAMA["max_position_embeddings"]
        elif args.model == "random":
            from engine.testing.models import BENCH_LLAMA_100M, build_random_llama

            model = str(build_random_llama(Path(tmp) / "llama-100m", BENCH_LLAMA_100M))
            vocab, max_len = BENCH_LLAMA_100M["vocab_size"], 1024
        else:
            model, vocab, max_len = args.model, *checkpoint_limits(Path(args.model))
        if args.max_tokens >= max_len // 2:
            parser.error(f"--max-tokens {args.max_tokens} leaves no room for prompts: "
                         f"it must be below half the context ({max_len} tokens)")
        rng = random.Random(1234)
        work = Workload(vocab, max_len, args.max_tokens,
                        [[rng.randrange(3, vocab) for _ in range(n)] for n in (16, 48, 96)])
        server = start_server(model, ["--dtype", args.dtype, "--max-model-len", str(max_len),
                                      "--disable-access-log", *server_args], base_args=())
        try:
            rows = asyncio.run(soak(server, work, args))
        finally:
            server.stop()
    print(summary(rows))


if __name__ == "__main__":
    main()
