"""Tensor-parallel worker ranks in spawned processes, fed hand-made steps (for tests).

``run_ranks(config, steps, num_blocks)`` starts ``config.tensor_parallel_size`` processes
(``spawn``), each builds ``Worker(prepare(config, process="worker"), rank=r, ...)`` over a
fresh ``tcp://127.0.0.1:PORT`` rendezvous, allocates ``num_blocks`` KV blocks, runs every
``SchedulerOutput`` of ``steps`` and reports its outputs and every logits tensor its model's
``compute_logits`` returned (rank 0: the full logits). ``drive_worker`` makes such steps:
the default scheduler driving one worker in this process (the TP=1 reference).
"""

from __future__ import annotations

import multiprocessing
import pickle
import queue
import socket
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


def free_tcp_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def capture_logits(model: Any) -> list[torch.Tensor]:
    """Record a copy of every ``model.compute_logits`` result; returns the (growing) list."""
    captured: list[torch.Tensor] = []
    compute = model.compute_logits

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = compute(hidden)
        captured.append(logits.detach().clone())
        return logits

    model.compute_logits = recording
    return captured


def drive_worker(worker: Any, requests: Sequence[Any], *, max_num_seqs: int,
                 ) -> tuple[list[Any], list[Any], list[torch.Tensor]]:
    """Run ``requests`` through the default scheduler and ``worker`` until all finish.

    Allocates the worker's whole KV cache first. Returns every ``SchedulerOutput``, every
    ``ModelRunnerOutput`` and every logits tensor its model computed, in order.
    """
    from engine.core.scheduler import Scheduler
    from engine.sdk.scheduler import SchedulerContext

    worker.initialize_cache(worker.num_available_blocks)
    logits = capture_logits(worker.model)
    setup = worker.setup
    scheduler = Scheduler(SchedulerContext(
        plugin_name="default", block_size=setup.block_size, num_kv_blocks=worker.num_blocks - 1,
        max_num_seqs=max_num_seqs, max_model_len=setup.max_model_len,
        max_num_batched_tokens=setup.max_num_batched_tokens))
    for request in requests:
        scheduler.add_request(request)
    steps, outputs = [], []
    while scheduler.has_unfinished_requests():
        step = scheduler.schedule()
        output = worker.execute_model(step)
        scheduler.update_from_output(step, output)
        steps.append(step)
        outputs.append(output)
    return steps, outputs, logits


@dataclass
class RankResult:
    """What one rank reports: its step outputs, logits, cache shapes, or the error."""

    rank: int
    outputs: list[Any] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    kv_cache_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    num_available_blocks: int = 0
    error: str | None = None


def run_rank(rank: int, init_method: str, config: Any, num_blocks: int,
             steps: Sequence[Any], results: Any) -> None:
    """Process target: one rank's worker runs ``steps``; puts a :class:`RankResult`."""
    result = RankResult(rank)
    worker = None
    try:
        from engine.core.startup import prepare
        from engine.core.worker.worker import Worker

        setup = prepare(config, process="worker")
        worker = Worker(setup, eos_token_id=None, rank=rank,
                        world_size=config.tensor_parallel_size,
                        distributed_init_method=init_method)
        result.num_available_blocks = worker.num_available_blocks
        worker.initialize_cache(num_blocks)
        result.kv_cache_shapes = {name: tuple(t.shape) for name, t in worker.kv_caches.items()}
        result.logits = capture_logits(worker.model)
        result.outputs = [worker.execute_model(step) for step in steps]
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
        result.error = traceback.format_exc()
    finally:
        if worker is not None:
            worker.shutdown()
            worker.shutdown()  # idempotent
    # Plain pickle: torch's queue pickler would share tensors with a process about to exit.
    results.put(pickle.dumps(result))


def run_ranks(config: Any, steps: Sequence[Any], num_blocks: int, *,
              timeout: float = 120.0) -> list[RankResult]:
    """Run every rank of ``config`` on ``steps``; results in rank order.

    Raises:
        RuntimeError: a rank failed (with its traceback) or did not finish in ``timeout``.
    """
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_tcp_port()}"
    size = config.tensor_parallel_size
    procs = [ctx.Process(target=run_rank, args=(rank, init_method, config, num_blocks,
                                                list(steps), results), daemon=True)
             for rank in range(size)]
    for proc in procs:
        proc.start()
    collected: dict[int, RankResult] = {}
    try:
        while len(collected) < size:
            item: RankResult = pickle.loads(results.get(timeout=timeout))
            collected[item.rank] = item
    except queue.Empty:
        failed = "".join(f"\nrank {r.rank}:\n{r.error}" for r in collected.values() if r.error)
        raise RuntimeError(f"tensor-parallel ranks did not finish within {timeout} s; done: "
                           f"{sorted(collected)}{failed}") from None
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    errors = [f"rank {r.rank}:\n{r.error}" for r in collected.values() if r.error]
    if errors:
        raise RuntimeError("\n".join(errors))
    return [collected[rank] for rank in range(size)]
