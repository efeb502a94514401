"""Online serving: ``engine serve`` under concurrent streaming clients.

Starts a real ``engine serve`` (EngineCore in its own process), measures the time from
launch to a ready ``/health``, then for each concurrency level sends the same prompts
(random token ids, ``ignore_eos``, greedy) as streaming completions and prints one table:
output tokens/s, TTFT and inter-token latency p50/p99.

    .venv/bin/python benchmarks/serve.py                      # the issue's workload
    .venv/bin/python benchmarks/serve.py --num-prompts 16 --output-len 32 --concurrency 1 16
    .venv/bin/python benchmarks/serve.py --concurrency 64 --num-threads 1   # + engine flags

Default workload: 64 prompts x 32 tokens in, 128 out, concurrency 1, 16 and 64, on the
random ~102M Llama (``--model random``) or ``--model default`` / a path. ``vllm bench serve
--backend openai --base-url ...`` speaks the same protocol (streaming completions).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import torch


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


async def one_request(client, model: str, prompt: list[int], output_len: int,
                      ttfts: list[float], itls: list[float]) -> int:
    """Stream one completion; record its TTFT and inter-token gaps; return its tokens."""
    start = time.perf_counter()
    last = None
    tokens = 0
    # Token ids in every chunk: random ids often decode to no text, and a chunk without
    # text is still a token that arrived.
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=output_len, temperature=0.0, stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    async for chunk in stream:
        extra = (chunk.choices[0].model_extra or {}) if chunk.choices else {}
        token_ids = extra.get("token_ids")
        if not token_ids:
            continue
        now = time.perf_counter()
        if last is None:
            ttfts.append(now - start)
        else:
            itls.append(now - last)
        last = now
        tokens += len(token_ids)
    return tokens


async def run_level(server, prompts: list[list[int]], concurrency: int,
                    output_len: int) -> tuple[float, list[float], list[float]]:
    client = server.async_client(timeout=600)
    semaphore = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []
    itls: list[float] = []

    async def bounded(prompt: list[int]) -> int:
        async with semaphore:
            return await one_request(client, server.model, prompt, output_len, ttfts, itls)

    start = time.perf_counter()
    await asyncio.gather(*(bounded(p) for p in prompts))
    elapsed = time.perf_counter() - start
    await client.close()
    return len(prompts) * output_len / elapsed, ttfts, itls


def main() -> None:
    from engine.testing.models import BENCH_LLAMA_100M, build_random_llama
    from engine.testing.server import start_server

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="random", help="random, default, or a path")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--dtype", default="float32")
    args, server_args = parser.parse_known_args()  # the rest goes to `engine serve`
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "random":
            model = str(build_random_llama(Path(tmp) / "llama-100m", BENCH_LLAMA_100M))
            vocab = BENCH_LLAMA_100M["vocab_size"]
        else:
            from engine.core.model_loader import default_model_path

            model = str(default_model_path()) if args.model == "default" else args.model
            vocab = 49152
        launch = time.perf_counter()
        server = start_server(model, ["--dtype", args.dtype,
                                      "--max-num-seqs", str(max(args.concurrency)),
                                      *server_args], base_args=())
        ready = time.perf_counter() - launch
        gen = torch.Generator().manual_seed(0)
        prompts = torch.randint(3, vocab, (args.num_prompts, args.input_len),
                                generator=gen).tolist()
        rows = []
        try:
            for level in args.concurrency:
                tps, ttfts, itls = asyncio.run(run_level(server, prompts, level,
                                                         args.output_len))
                rows.append((level, tps, ttfts, itls))
        finally:
            server.stop()
    print(f"\nworkload: {args.num_prompts} prompts x {args.input_len} tokens -> "
          f"{args.output_len} new, greedy, EOS ignored, {args.dtype}; ready after "
          f"{ready:.1f} s (launch to /health 200)")
    print(f"{'concurrency':>11} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'ITL p50':>8} {'ITL p99':>8}  (seconds / milliseconds)")
    for level, tps, ttfts, itls in rows:
        print(f"{level:>11} {tps:10.1f} {statistics.median(ttfts):8.2f}s "
              f"{percentile(ttfts, 99):8.2f}s {1000 * statistics.median(itls):7.1f}m "
              f"{1000 * percentile(itls, 99):7.1f}m")


if __name__ == "__main__":
    main()
