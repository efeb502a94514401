"""Per-step cost of the worker channel (``mp`` vs ``uni``) and of tensor parallelism.

Workload (default): 64 prompts x 32 random token ids -> 32 new tokens each, greedy, EOS
ignored, bfloat16 (``--dtype``), on the random ~102M Llama of ``channel_overhead.py``
(``--model 100m``: hidden 768, 12 layers, 12/4 heads, intermediate 2560, vocab 8192) or
the tiny test checkpoint. Every engine configuration runs in its own spawned helper
process, which builds ``EngineCore`` once and keeps it loaded (an idle one sleeps); the
configurations alternate ``--repeats`` times and the tables show medians.

    .venv/bin/python benchmarks/worker_channel.py --model 100m --threads 1
    .venv/bin/python benchmarks/worker_channel.py --model 100m --threads 1 --tp

Worker channel table: ``uni`` (the worker inside EngineCore) against ``mp`` (the worker in
its own process behind ``worker.proto``) at TP=1, ``--threads`` torch threads each.
``decode ms/step`` is the median EngineCore ``step()`` of the decode steps (the first,
prefill, step left out); ``worker ms`` is the median ``execute_model`` inside the worker
(timed by a worker extension of this script) and ``worker CPU ms`` that thread's CPU time
(well below ``worker ms`` when other processes took the cores); ``around ms`` (EngineCore's
step minus the worker's ``execute_model``, step by step) is what a step costs around the
model: scheduling and output handling, plus the channel for ``mp``.
Then, for the middle decode step of the run: the codec alone (``encode_scheduler_output``
and the ``ModelRunnerOutput`` decode in EngineCore, their inverses in the worker) and a
round trip of that step over the channel to a worker process that answers at once.

``--tp`` adds TP=1 ``uni`` with 2 threads and TP=2 (``mp``, 1 thread per rank, so 2 cores
in all) and the collectives table: in the TP=2 run the worker extension times every
``torch.distributed`` call of a step on each rank (waits for the other rank included), and
two spawned processes time the collectives of one step alone on gloo (per decode step: 2
all-reduces per layer + 1 for the vocab-parallel embedding of batch x hidden, the
LM-head gather of batch x vocab/2 to rank 0, the broadcast of the sampled ids).

On a shared 2-core machine use ``--threads 1`` (see ``channel_overhead.py``).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from channel_overhead import build_model, make_requests, random_prompts

from engine.sdk.worker_extension import WorkerExtension

SPAWN = multiprocessing.get_context("spawn")
COLLECTIVES = ("all_reduce", "gather", "broadcast")


class StepProbe(WorkerExtension):
    """Times ``execute_model`` and the ``torch.distributed`` calls of every step on a rank."""

    name = "step_probe"

    def init_worker_extension(self) -> None:
        import torch.distributed as dist

        # per step: execute_model wall s, its thread's CPU s, then wall s per collective
        self.probe_rows: list[list[float]] = []
        self._probe_now = dict.fromkeys(COLLECTIVES, 0.0)
        for op in COLLECTIVES:
            setattr(dist, op, self._probe_timed(op, getattr(dist, op)))
        run = self.model_runner.execute_model

        def execute_model(scheduler_output: Any) -> Any:
            self._probe_now = dict.fromkeys(COLLECTIVES, 0.0)
            start, cpu = time.perf_counter(), time.thread_time()
            out = run(scheduler_output)
            self.probe_rows.append([time.perf_counter() - start, time.thread_time() - cpu,
                                    *(self._probe_now[op] for op in COLLECTIVES)])
            return out

        self.model_runner.execute_model = execute_model

    def _probe_timed(self, op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._probe_now[op] += time.perf_counter() - start
        return timed

    def probe_take(self) -> list[list[float]]:
        """The rows recorded since the last call (one per step), then forget them."""
        rows, self.probe_rows = self.probe_rows, []
        return rows


@dataclass(frozen=True)
class Case:
    """One engine configuration of the tables."""

    label: str
    backend: str
    tp: int
    threads: int


@dataclass
class Run:
    """One timed run in a helper: EngineCore step seconds, per-rank probe rows, tokens."""

    step_s: list[float]
    probe: list[list[list[float]]]
    tokens: dict[str, list[int]]
    capture: tuple[bytes, bytes] | None = None


_CORE: Any = None  # the helper process's EngineCore


def engine_run(config_json: str, prompts: list[list[int]], output_len: int, tag: str,
               capture_step: int | None = None) -> Run:
    """In a helper process: build EngineCore once, run the workload, step by step."""
    global _CORE
    from engine.core.config import EngineConfig
    from engine.core.engine.engine_core import EngineCore
    from engine.core.startup import prepare

    if _CORE is None:
        _CORE = EngineCore(prepare(EngineConfig.model_validate_json(config_json)),
                           eos_token_id=None)
    core = _CORE
    captured: list[tuple[bytes, bytes]] = []
    if capture_step is not None:
        core.executor.execute_model = capturing(core.executor, capture_step, captured)
    core.collective_rpc("probe_take")
    tokens: dict[str, list[int]] = {}
    step_s = []
    core.add_requests(make_requests(prompts, output_len, tag))
    while core.has_unfinished_requests():
        start = time.perf_counter()
        outputs = core.step()
        step_s.append(time.perf_counter() - start)
        for output in outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    if capture_step is not None:
        del core.executor.execute_model
    probe = core.collective_rpc("probe_take")
    return Run(step_s, probe, tokens, captured[0] if captured else None)


def capturing(executor: Any, step: int, into: list[tuple[bytes, bytes]]) -> Any:
    """``executor.execute_model`` that keeps step ``step``'s wire bytes (request, response)."""
    from engine.core.rpc._gen import worker_pb2 as pb
    from engine.core.rpc.worker_client import encode_scheduler_output
    from engine.core.rpc.worker_convert import runner_output_to_proto

    execute, count = type(executor).execute_model, [0]

    def execute_model(scheduler_output: Any) -> Any:
        out = execute(executor, scheduler_output)
        count[0] += 1
        if count[0] == step + 1:
            response = pb.ExecuteModelResponse()
            runner_output_to_proto(out, response.output)
            into.append((encode_scheduler_output(scheduler_output),
                         response.SerializeToString()))
        return out

    return execute_model


def engine_close() -> None:
    """In a helper process: stop EngineCore and its workers (before the pool exits)."""
    if _CORE is not None:
        _CORE.shutdown()


def codec_us(payload: bytes, response: bytes, repeats: int = 300) -> dict[str, float]:
    """CPU time (us) of each half of one step's messages, on both ends of the channel."""
    from engine.core.rpc._gen import worker_pb2 as pb
    from engine.core.rpc.worker_client import encode_scheduler_output
    from engine.core.rpc.worker_convert import (
        runner_output_from_proto,
        runner_output_to_proto,
        scheduler_output_from_proto,
    )

    scheduler_output = scheduler_output_from_proto(pb.SchedulerOutput.FromString(payload))
    runner_output = runner_output_from_proto(pb.ExecuteModelResponse.FromString(response).output)

    def encode_response() -> bytes:
        msg = pb.ExecuteModelResponse()
        runner_output_to_proto(runner_output, msg.output)
        return msg.SerializeToString()

    parts: dict[str, Callable[[], Any]] = {
        "core encode": lambda: encode_scheduler_output(scheduler_output),
        "core decode": lambda: runner_output_from_proto(
            pb.ExecuteModelResponse.FromString(response).output),
        "worker decode": lambda: scheduler_output_from_proto(
            pb.SchedulerOutput.FromString(payload)),
        "worker encode": encode_response,
    }
    timings = {}
    for name, fn in parts.items():
        fn()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        timings[name] = (time.perf_counter() - start) / repeats * 1e6
    return timings


class CannedWorker:
    """A worker whose every step answers at once with one recorded output."""

    rank = 0
    num_available_blocks = 2

    def __init__(self, response: bytes) -> None:
        from engine.core.rpc._gen import worker_pb2 as pb
        from engine.core.rpc.worker_convert import runner_output_from_proto

        self.output = runner_output_from_proto(
            pb.ExecuteModelResponse.FromString(response).output)

    def initialize_cache(self, num_blocks: int) -> None:
        pass

    def execute_model(self, scheduler_output: Any) -> Any:
        return self.output

    def collective_rpc(self, method: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        return None

    def check_health(self) -> None:
        pass


def serve_canned(address: str, response: bytes, threads: int, ready: Any) -> None:
    """In a spawned process: serve ``worker.proto`` over :class:`CannedWorker` until told."""
    from engine.core.rpc.worker_server import make_worker_server

    torch.set_num_threads(threads)
    pool = ThreadPoolExecutor(4)
    stop = threading.Event()
    server, _ = make_worker_server(CannedWorker(response), address, executor=pool,
                                   shutdown_event=stop)
    ready.send(True)
    stop.wait()
    server.stop(0.5).wait()
    pool.shutdown()


def round_trip_ms(payload: bytes, response: bytes, threads: int, workdir: Path,
                  repeats: int = 200) -> float:
    """Median ms of one step's ``ExecuteModel`` call to a worker that answers at once."""
    from engine.core.rpc.worker_client import WorkerClient

    address = f"unix:{workdir / 'canned.sock'}"
    reader, writer = SPAWN.Pipe(duplex=False)
    process = SPAWN.Process(target=serve_canned, args=(address, response, threads, writer))
    process.start()
    try:
        if not reader.poll(120):
            raise SystemExit("the canned worker did not start")
        reader.recv()
        client = WorkerClient(address, rank=0)
        client.wait_ready(60)
        times = []
        for i in range(repeats + 20):
            start = time.perf_counter()
            client.execute_model_future(payload).result()
            if i >= 20:
                times.append(time.perf_counter() - start)
        client.shutdown()
        client.close()
    finally:
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join()
    return statistics.median(times) * 1e3


def collectives_rank(rank: int, port: int, shape: tuple[int, int, int, int, int], dtype: str,
                     steps: int) -> dict[str, float] | None:
    """In one of 2 spawned processes: median ms per step of each collective, alone."""
    import torch.distributed as dist

    tokens, batch, hidden, vocab, layers = shape
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    dt = getattr(torch, dtype)
    hiddens = [torch.randn(tokens, hidden).to(dt) for _ in range(2 * layers + 1)]
    logits = torch.randn(batch, vocab // 2).to(dt)
    ids = torch.zeros(batch, dtype=torch.int64)
    times: dict[str, list[float]] = {op: [] for op in COLLECTIVES}
    for step in range(steps + 5):
        dist.barrier()
        marks = [time.perf_counter()]
        for tensor in hiddens:
            dist.all_reduce(tensor)
        marks.append(time.perf_counter())
        parts = [torch.empty_like(logits) for _ in range(2)] if rank == 0 else None
        dist.gather(logits, parts, dst=0)
        marks.append(time.perf_counter())
        dist.broadcast(ids, src=0)
        marks.append(time.perf_counter())
        if step >= 5:
            for op, begin, end in zip(COLLECTIVES, marks[:-1], marks[1:], strict=True):
                times[op].append(end - begin)
    dist.destroy_process_group()
    return {op: statistics.median(t) * 1e3 for op, t in times.items()} if rank == 0 else None


def collectives_alone(shape: tuple[int, int, int, int, int], dtype: str, steps: int = 50
                      ) -> dict[str, float]:
    """One step's collectives, timed alone on 2 gloo ranks (1 thread each).

    ``shape`` is (tokens, batch, hidden, vocab, layers): the all-reduces carry tokens x
    hidden, the LM-head gather batch x vocab/2, the broadcast batch ids.
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with ProcessPoolExecutor(2, mp_context=SPAWN) as pool:
        futures = [pool.submit(collectives_rank, rank, port, shape, dtype, steps)
                   for rank in range(2)]
        result = futures[0].result()
        futures[1].result()
    if result is None:
        raise RuntimeError("rank 0 returned no timings")
    return result


def median_of(runs: list[Run], per_run: Callable[[Run], float]) -> float:
    return statistics.median(per_run(run) for run in runs)


def decode_ms(run: Run) -> float:
    return statistics.median(run.step_s[1:]) * 1e3


def around_ms(run: Run) -> float:
    """Median over a run's decode steps of EngineCore's step minus rank 0's execute_model."""
    rows = run.probe[0]
    if len(rows) != len(run.step_s):
        raise RuntimeError(f"{len(run.step_s)} steps but {len(rows)} execute_model calls")
    return statistics.median(step - row[0] for step, row in zip(
        run.step_s[1:], rows[1:], strict=True)) * 1e3


def probe_ms(rank: int, columns: slice) -> Callable[[Run], float]:
    """Median over a run's decode steps of the sum of probe ``columns`` on ``rank``, in ms."""
    return lambda run: statistics.median(sum(row[columns]) for row in run.probe[rank][1:]) * 1e3


def run_cases(args: argparse.Namespace, cases: list[Case], workdir: Path
              ) -> tuple[dict[Case, list[Run]], tuple[bytes, bytes]]:
    from engine.core.config import EngineConfig

    path, vocab = build_model(args.model, workdir)
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    pools = {case: ProcessPoolExecutor(1, mp_context=SPAWN) for case in cases}
    configs = {case: EngineConfig(
        model=str(path), dtype=args.dtype, num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=max(args.num_prompts, 1), num_threads=case.threads,
        max_model_len=args.input_len + args.output_len + 16, tensor_parallel_size=case.tp,
        distributed_executor_backend=case.backend,
        worker_extensions=("worker_channel:StepProbe",)).model_dump_json() for case in cases}
    runs: dict[Case, list[Run]] = {case: [] for case in cases}
    try:
        for case in cases:  # load + warm up (the idle ones sleep while another runs)
            pools[case].submit(engine_run, configs[case], prompts[:4], 4, "warm").result()
        for r in range(args.repeats):  # interleaved, so every case sees the same machine
            for case in cases:
                step = args.output_len // 2 if r == 0 and case == cases[0] else None
                runs[case].append(pools[case].submit(
                    engine_run, configs[case], prompts, args.output_len,
                    f"{case.backend}{case.tp}x{case.threads}r{r}", step).result())
    finally:
        for pool in pools.values():
            pool.submit(engine_close).result()
            pool.shutdown()
    capture = runs[cases[0]][0].capture
    if capture is None:
        raise RuntimeError("no decode step was captured")
    return runs, capture


def same_tokens(a: Run, b: Run) -> float:
    """The fraction of requests whose tokens agree (request ids differ by tag only)."""
    def by_index(run: Run) -> list[list[int]]:
        return [t for _, t in sorted((int(k.rsplit("-", 1)[1]), v)
                                     for k, v in run.tokens.items())]
    pairs = list(zip(by_index(a), by_index(b), strict=True))
    return sum(x == y for x, y in pairs) / len(pairs)


def print_channel(args: argparse.Namespace, runs: dict[Case, list[Run]], uni: Case, mp: Case,
                  capture: tuple[bytes, bytes], workdir: Path) -> None:
    if same_tokens(runs[uni][0], runs[mp][0]) != 1.0:
        raise SystemExit("mp produced different tokens from uni")
    print(f"\nworker channel: TP=1, {args.threads} thread(s); {args.num_prompts} prompts x "
          f"{args.input_len} -> {args.output_len} new tokens, greedy, {args.dtype}, model "
          f"{args.model}, median of {args.repeats}")
    print(f"{'backend':<8} {'steps':>5} {'ms/step':>9} {'decode ms/step':>15} "
          f"{'worker ms':>10} {'worker CPU ms':>14} {'around ms':>10} {'overhead ms/step':>17} "
          f"{'% of step':>10}")
    base = median_of(runs[uni], decode_ms)
    around = {}
    for case in (uni, mp):
        all_ms = median_of(runs[case], lambda run: sum(run.step_s) / len(run.step_s) * 1e3)
        step_ms = median_of(runs[case], decode_ms)
        worker_ms = median_of(runs[case], probe_ms(0, slice(0, 1)))
        cpu_ms = median_of(runs[case], probe_ms(0, slice(1, 2)))
        around[case] = median_of(runs[case], around_ms)
        print(f"{case.backend:<8} {len(runs[case][0].step_s):5d} {all_ms:9.2f} {step_ms:15.2f} "
              f"{worker_ms:10.2f} {cpu_ms:14.2f} {around[case]:10.2f} "
              f"{step_ms - base:17.2f} "
              f"{(step_ms - base) / base * 100:9.1f}%")
    channel = around[mp] - around[uni]
    print(f"the channel on the step's path (around ms of mp - uni): {channel:.2f} ms = "
          f"{channel / base:.1%} of a step; decode ms/step per run: " + "; ".join(
              f"{case.backend} " + " ".join(f"{decode_ms(run):.1f}" for run in runs[case])
              for case in (uni, mp)))
    payload, response = capture
    codec = codec_us(payload, response)
    print(f"codec of decode step {args.output_len // 2} ({len(payload)} B request, "
          f"{len(response)} B response), us: " + ", ".join(
              f"{name} {us:.0f}" for name, us in codec.items()))
    print(f"round trip of that step to a worker process that answers at once: "
          f"{round_trip_ms(payload, response, args.threads, workdir):.2f} ms (median of 200)")


def print_tp(args: argparse.Namespace, runs: dict[Case, list[Run]], cases: list[Case]
             ) -> None:
    from engine.testing.models import BENCH_LLAMA_100M, TINY_LLAMA

    config = {"tiny": TINY_LLAMA, "100m": BENCH_LLAMA_100M}[args.model]
    hidden, vocab, layers = (int(config[k]) for k in (
        "hidden_size", "vocab_size", "num_hidden_layers"))
    batch = args.num_prompts
    alone = collectives_alone((batch, batch, hidden, vocab, layers), args.dtype)
    prefill = collectives_alone((batch * args.input_len, batch, hidden, vocab, layers),
                                args.dtype, steps=20)
    tp2 = next(case for case in cases if case.tp == 2)
    if (agree := same_tokens(runs[cases[0]][0], runs[tp2][0])) != 1.0:
        print(f"note: TP=2 tokens agree with TP=1 for {agree:.0%} of the requests "
              f"(the all-reduce sums in another order)")
    print(f"\ntensor parallelism: {args.num_prompts} prompts x {args.input_len} -> "
          f"{args.output_len} new tokens, greedy, {args.dtype}, model {args.model}, median "
          f"of {args.repeats}; all-reduce: {2 * layers + 1} x {batch}x{hidden} per decode step")
    print(f"{'config':<22} {'cores':>5} {'decode ms/step':>15} {'vs TP=1':>8} "
          f"{'all-reduce in run r0/r1':>24} {'collectives in run':>19} {'tok/s':>7}")
    ref = median_of(runs[cases[0]], decode_ms)
    for case in cases:
        step_ms = median_of(runs[case], decode_ms)
        in_run = all_run = "-"
        if case.tp > 1:
            ar = [median_of(runs[case], probe_ms(rank, slice(2, 3))) for rank in range(2)]
            every = median_of(runs[case], probe_ms(0, slice(2, None)))
            in_run = f"{ar[0]:.2f} / {ar[1]:.2f} ({ar[0] / step_ms:.0%})"
            all_run = f"{every:.2f} ({every / step_ms:.0%})"
        print(f"{case.label:<22} {case.tp * case.threads:5d} {step_ms:15.2f} "
              f"{step_ms / ref:8.2f} {in_run:>24} {all_run:>19} "
              f"{args.num_prompts / step_ms * 1e3:7.1f}")
    tp2_ms = median_of(runs[tp2], decode_ms)
    for name, timings in (("decode step", alone), (f"prefill step ({batch * args.input_len} "
                                                   f"tokens)", prefill)):
        total = sum(timings.values())
        print(f"collectives alone (2 gloo processes, 1 thread each), one {name}: all-reduce "
              f"{timings['all_reduce']:.2f} ms, LM-head gather {timings['gather']:.2f} ms, "
              f"broadcast {timings['broadcast']:.3f} ms; {total:.2f} ms in all"
              + (f" = {total / tp2_ms:.1%} of the TP=2 decode step" if name == "decode step"
                 else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["tiny", "100m"], default="tiny")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--num-kv-blocks", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--tp", action="store_true",
                        help="add TP=1 with 2 threads, TP=2 with 1 thread per rank, and the "
                        "collectives table")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    uni = Case(f"TP=1 uni {args.threads} thr", "uni", 1, args.threads)
    mp = Case(f"TP=1 mp {args.threads} thr", "mp", 1, args.threads)
    cases = [uni, mp]
    if args.tp:
        if args.threads != 2:
            cases.append(Case("TP=1 uni 2 thr", "uni", 1, 2))
        cases.append(Case("TP=2 mp 1 thr/rank", "mp", 2, 1))
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        runs, capture = run_cases(args, cases, Path(tmp))
        print(f"\nload average (1 min) before the runs {load_before:.2f}, after "
              f"{os.getloadavg()[0]:.2f}")
        print_channel(args, runs, uni, mp, capture, Path(tmp))
        if args.tp:
            print_tp(args, runs, cases)


if __name__ == "__main__":
    main()
