"""Per-step cost of the gRPC channel: EngineCore directly vs EngineCore behind GrpcCoreClient.

Workload (default): 64 prompts x 32 random token ids -> 32 new tokens each, greedy, EOS
ignored, float32, on a random-initialised Llama built in a temp dir (``--model tiny``: the
test checkpoint, hidden 64, 2 layers; ``--model 100m``: hidden 768, 12 layers, ~102M
parameters). Both runs add every request at once and step until all have finished; the
two paths alternate ``--repeats`` times (both engines stay loaded; an idle one sleeps) and
the table shows medians.

    .venv/bin/python benchmarks/channel_overhead.py
    .venv/bin/python benchmarks/channel_overhead.py --model 100m --repeats 2

``direct`` steps EngineCore in a spawned helper process (fresh, like EngineCore's own, so
the two differ only by the channel). ``grpc`` spawns the EngineCore process and
drives it through GrpcCoreClient: requests go in on the stream, one message per step comes
back, and the time runs until the last request's final output has been decoded here.
``overhead ms/step`` is the difference of the two per-step times; ``delivery ms`` is how
long after EngineCore finished a step its outputs were decoded in the front end (median
over steps). ``codec`` times the message of one decode step alone: build + serialise in
EngineCore (on its loop thread, between steps) and parse + convert in the front end.

On a shared 2-core machine use ``--threads 1``: with two torch threads, other processes
make OpenMP barriers so slow that the spread between runs dwarfs the channel.

This is the front end's channel to EngineCore. The other channel, from EngineCore to its
worker processes (``--distributed-executor-backend mp``, ``worker.proto``), and tensor
parallelism are measured by ``worker_channel.py`` on the same workload.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
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
    """Steps, seconds, median delivery latency (ms) and tokens of one run over the channel."""
    tokens: dict[str, list[int]] = {}
    remaining = {r.request_id for r in requests}
    latencies: list[float] = []
    outputs = client.outputs()
    start = time.perf_counter()
    client.add_requests(requests)
    steps = 0
    async for step in outputs:
        steps += 1
        for output in step.outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finished:
                remaining.discard(output.request_id)
        latencies.append(time.time() - step.timestamp)  # same clock in both processes
        if not remaining:
            break
    elapsed = time.perf_counter() - start
    await outputs.aclose()
    return steps, elapsed, statistics.median(latencies) * 1e3, tokens


def codec_us_per_step(num_requests: int, repeats: int = 200) -> tuple[float, float]:
    """CPU cost of one decode step's message: (EngineCore side, front-end side) in us."""
    from engine.core.rpc import convert
    from engine.core.rpc._gen import engine_core_pb2 as pb
    from engine.sdk.scheduler import EngineCoreOutput
    from engine.sdk.stats import SchedulerStats

    outputs = [EngineCoreOutput(f"req-{i}", (1000 + i,)) for i in range(num_requests)]
    start = time.perf_counter()
    for _ in range(repeats):
        data = pb.ServerMessage(step=convert.step_outputs_to_proto(
            outputs, SchedulerStats(), time.time())).SerializeToString()
    encode = (time.perf_counter() - start) / repeats
    start = time.perf_counter()
    for _ in range(repeats):
        convert.step_outputs_from_proto(pb.ServerMessage.FromString(data).step)
    decode = (time.perf_counter() - start) / repeats
    return encode * 1e6, decode * 1e6


def build_model(name: str, workdir: Path) -> tuple[Path, int]:
    from engine.testing.models import BENCH_LLAMA_100M, TINY_LLAMA, build_random_llama

    config = {"tiny": TINY_LLAMA, "100m": BENCH_LLAMA_100M}[name]
    return build_random_llama(workdir / f"llama-{name}", config), int(config["vocab_size"])


_CORE: Any = None  # the direct path's EngineCore, in its worker process


def direct_worker(config_json: str, prompts: list[list[int]], output_len: int, tag: str
                  ) -> tuple[int, float, dict[str, list[int]]]:
    """Runs in a spawned process: build EngineCore once, then run the workload on it."""
    global _CORE
    from engine.core.config import EngineConfig
    from engine.core.engine.engine_core import EngineCore
    from engine.core.startup import prepare

    if _CORE is None:
        _CORE = EngineCore(prepare(EngineConfig.model_validate_json(config_json)),
                           eos_token_id=None)
    return run_direct(_CORE, make_requests(prompts, output_len, tag))


async def bench(args: argparse.Namespace, workdir: Path
                ) -> list[tuple[str, int, float, float | None]]:
    from engine.core.config import EngineConfig
    from engine.core.rpc import GrpcCoreClient
    from engine.core.startup import prepare

    path, vocab = build_model(args.model, workdir)
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    config = EngineConfig(model=str(path), dtype=args.dtype, num_kv_blocks=args.num_kv_blocks,
                          max_num_seqs=max(args.num_prompts, 1), num_threads=args.threads,
                          max_model_len=args.input_len + args.output_len + 16)
    setup = prepare(config)
    # The direct path runs in a fresh spawned process too, so the two differ only by the
    # channel (not by what this process imported or built before).
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    loop = asyncio.get_running_loop()

    def direct(r: int, prompts: list[list[int]], output_len: int) -> Any:
        return loop.run_in_executor(pool, direct_worker, config.model_dump_json(), prompts,
                                    output_len, f"d{r}")

    client = GrpcCoreClient(config, setup.manifest, eos_token_id=None)
    await client.start()
    try:
        await direct(-1, prompts[:4], 4)
        await run_grpc(client, make_requests(prompts[:4], 4, "warm"))
        direct_runs, grpc_runs = [], []
        for r in range(args.repeats):  # interleaved, so both see the same machine load
            direct_runs.append(await direct(r, prompts, args.output_len))
            grpc_runs.append(await run_grpc(client, make_requests(prompts, args.output_len,
                                                              f"g{r}")))
    finally:
        await client.shutdown()
        pool.shutdown()

    want = [t for _, t in sorted((int(k.split("-")[1]), v)
                                 for k, v in direct_runs[0][2].items())]
    got = [t for _, t in sorted((int(k.split("-")[1]), v) for k, v in grpc_runs[0][3].items())]
    if want != got:
        raise SystemExit("the gRPC run produced different tokens from the direct run")
    direct_ms = statistics.median(e / s * 1e3 for s, e, _ in direct_runs)
    grpc_ms = statistics.median(e / s * 1e3 for s, e, _, _ in grpc_runs)
    delivery_ms = statistics.median(m for _, _, m, _ in grpc_runs)
    return [("direct", direct_runs[0][0], direct_ms, None),
            ("grpc", grpc_runs[0][0], grpc_ms, delivery_ms)]


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
    print(f"{'path':<8} {'steps':>6} {'ms/step':>9} {'overhead ms/step':>17} "
          f"{'delivery ms':>12} {'tok/s':>9}")
    encode_us, decode_us = codec_us_per_step(args.num_prompts)
    base = rows[0][2]
    tokens = args.num_prompts * args.output_len
    for name, steps, ms, delivery_ms in rows:
        delivery = "-" if delivery_ms is None else f"{delivery_ms:.2f}"
        print(f"{name:<8} {steps:6d} {ms:9.2f} {ms - base:17.2f} {delivery:>12} "
              f"{tokens / (steps * ms / 1e3):9.1f}")
    print(f"codec CPU per decode step of {args.num_prompts} requests: encode + serialise "
          f"{encode_us:.0f} us (EngineCore's loop thread), parse + decode "
          f"{decode_us:.0f} us (front end)")


if __name__ == "__main__":
    main()
