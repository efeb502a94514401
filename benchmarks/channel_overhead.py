"""Per-step cost of the gRPC channel: EngineCore directly vs EngineCore behind GrpcCoreClient.

Workload (default): 64 prompts x 32 random token ids -> 32 new tokens each, greedy, EOS
ignored, float32, on a random-initialised Llama built in a temp dir (``--model tiny``: the
test checkpoint, hidden 64, 2 layers; ``--model 100m``: hidden 768, 12 layers, ~102M
parameters). Both runs add every request at once and step until all have finished; the
two paths alternate ``--repeats`` times (both engines stay loaded; an idle one sleeps) and
the table shows medians.

    .venv/bin/python benchmarks/channel_overhead.py
    .venv/bin/python benchmarks/channel_overhead.py --model 100m --repeats 2

``direct`` steps EngineCore in this process. ``grpc`` spawns the EngineCore process and
drives it through GrpcCoreClient: requests go in on the stream, one message per step comes
back, and the time runs until the last request's final output has been decoded here.
``engine ms/step`` is measured inside EngineCore (spacing of the step timestamps), so
``grpc ms/step - engine ms/step`` is what the channel adds to each step as the front end sees it.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (num, length), generator=gen).tolist()


def make_requests(prompts: list[list[int]], output_len: int, tag: str) -> list[Any]:
    from engine.sdk.sampling_params import SamplingParams
    from engine.sdk.scheduler import EngineRequest

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    return [EngineRequest(f"{tag}-{i}", tuple(p), params) for i, p in enumerate(prompts)]


def run_direct(core: Any, requests: list[Any]) -> tuple[int, float, dict[str, list[int]]]:
    tokens: dict[str, list[int]] = {}
    start = time.perf_counter()
    for request in requests:
        core.add_request(request)
    steps = 0
    while core.has_unfinished_requests():
        for output in core.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        steps += 1
    return steps, time.perf_counter() - start, tokens


async def run_grpc(client: Any, requests: list[Any]
                   ) -> tuple[int, float, float, dict[str, list[int]]]:
    tokens: dict[str, list[int]] = {}
    remaining = {r.request_id for r in requests}
    stamps: list[float] = []
    outputs = client.outputs()
    start = time.perf_counter()
    client.add_requests(requests)
    steps = 0
    async for step in outputs:
        steps += 1
        stamps.append(step.timestamp)
        for output in step.outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finished:
                remaining.discard(output.request_id)
        if not remaining:
            break
    elapsed = time.perf_counter() - start
    await outputs.aclose()
    engine_ms = (stamps[-1] - stamps[0]) / max(len(stamps) - 1, 1) * 1e3
    return steps, elapsed, engine_ms, tokens


def build_model(name: str, workdir: Path) -> tuple[Path, int]:
    from engine.testing.models import BENCH_LLAMA_100M, TINY_LLAMA, build_random_llama

    config = {"tiny": TINY_LLAMA, "100m": BENCH_LLAMA_100M}[name]
    return build_random_llama(workdir / f"llama-{name}", config), int(config["vocab_size"])


async def bench(args: argparse.Namespace, workdir: Path) -> list[tuple[str, int, float, float]]:
    from engine.core.config import EngineConfig
    from engine.core.engine_core import EngineCore
    from engine.core.rpc import GrpcCoreClient
    from engine.core.startup import prepare

    path, vocab = build_model(args.model, workdir)
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    config = EngineConfig(model=str(path), dtype=args.dtype, num_kv_blocks=args.num_kv_blocks,
                          max_num_seqs=max(args.num_prompts, 1), num_threads=args.threads,
                          max_model_len=args.input_len + args.output_len + 16)
    setup = prepare(config)
    warm = make_requests(prompts[:4], 4, "warm")

    core = EngineCore(setup, eos_token_id=None)
    client = GrpcCoreClient(config, setup.manifest, eos_token_id=None)
    await client.start()
    try:
        run_direct(core, warm)
        await run_grpc(client, warm)
        direct, grpc = [], []
        for r in range(args.repeats):  # interleaved, so both see the same machine load
            direct.append(run_direct(core, make_requests(prompts, args.output_len, f"d{r}")))
            grpc.append(await run_grpc(client, make_requests(prompts, args.output_len,
                                                             f"g{r}")))
    finally:
        await client.shutdown()
        core.shutdown()

    want = [t for _, t in sorted((int(k.split("-")[1]), v) for k, v in direct[0][2].items())]
    got = [t for _, t in sorted((int(k.split("-")[1]), v) for k, v in grpc[0][3].items())]
    if want != got:
        raise SystemExit("the gRPC run produced different tokens from the direct run")
    direct_ms = statistics.median(e / s * 1e3 for s, e, _ in direct)
    grpc_ms = statistics.median(e / s * 1e3 for s, e, _, _ in grpc)
    engine_ms = statistics.median(m for _, _, m, _ in grpc)
    return [("direct", direct[0][0], direct_ms, direct_ms),
            ("grpc", grpc[0][0], grpc_ms, engine_ms)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["tiny", "100m"], default="tiny")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--num-kv-blocks", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = asyncio.run(bench(args, Path(tmp)))
    print(f"\nworkload: {args.num_prompts} prompts x {args.input_len} tokens -> "
          f"{args.output_len} new tokens, greedy, EOS ignored, {args.dtype}, model "
          f"{args.model}, median of {args.repeats}")
    print(f"{'path':<8} {'steps':>6} {'ms/step':>9} {'engine ms/step':>15} "
          f"{'overhead ms/step':>17} {'tok/s':>9}")
    base = rows[0][2]
    tokens = args.num_prompts * args.output_len
    for name, steps, ms, engine_ms in rows:
        print(f"{name:<8} {steps:6d} {ms:9.2f} {engine_ms:15.2f} {ms - base:17.2f} "
              f"{tokens / (steps * ms / 1e3):9.1f}")


if __name__ == "__main__":
    main()
