"""A worker process of the ``mp`` executor: one tensor-parallel rank.

Life of the process (spawned by ``MultiprocExecutor`` in EngineCore's process)::

    spawn -> watch the parent (exit within ~0.2 s of EngineCore's death)
          -> EngineConfig from JSON; prepare(); the front end's manifest.verify()
          -> WorkerRuntime: torch.distributed with the other ranks, the model's shard
          -> gRPC server (proto/engine/v1/worker.proto) on its unix socket
          -> {"ready": address, "num_available_blocks": n} (or {"error": ...}) to the parent
          -> serve until Shutdown or SIGTERM, then exit

SIGINT is ignored: Ctrl-C reaches the whole process group, and EngineCore owns stopping
its workers.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from engine.core.config import EngineConfig
from engine.core.heap import defer_full_collections, freeze_startup_heap
from engine.core.plugins import PluginManifest
from engine.core.rpc.process import describe_error, exit_process, send_message, watch_parent

if TYPE_CHECKING:
    from engine.core.worker.runtime import WorkerRuntime

logger = logging.getLogger("engine.worker")

#: Seconds in-flight RPCs get to finish once the worker is told to stop.
STOP_GRACE_S = 0.5


@dataclass(frozen=True)
class WorkerProcessArgs:
    """What EngineCore hands a worker process at spawn (plain values; JSON inside).

    Attributes:
        config_json: ``EngineConfig.model_dump_json()``.
        manifest_json: The front end's ``PluginManifest.to_json()``; the worker loads
            exactly these plugins and refuses to start when its own differ.
        eos_token_id: The tokenizer's EOS id, for the sampler.
        rank: This worker's tensor-parallel rank.
        world_size: Number of ranks.
        distributed_init_method: ``tcp://host:port`` of the torch.distributed rendezvous.
        address: ``unix:PATH`` to serve worker.proto on.
        log_level: Level for the ``engine`` loggers in this process.
    """

    config_json: str
    manifest_json: str
    eos_token_id: int | None
    rank: int
    world_size: int
    distributed_init_method: str | None
    address: str
    log_level: int = logging.INFO


def run_worker_process(args: WorkerProcessArgs, ready: Connection) -> None:
    """Entry point of the spawned process: build, serve, exit (status 0 after a clean stop)."""
    defer_full_collections()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s [worker {args.rank}] %(name)s: "
                               f"%(message)s")
    parent = multiprocessing.parent_process()
    threading.Thread(target=watch_parent,
                     args=(parent.pid if parent else os.getppid(), None),
                     kwargs={"me": f"worker rank {args.rank}", "parent": "EngineCore"},
                     name="engine-worker-parent-watch", daemon=True).start()
    pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="engine-worker-grpc")
    runtime: WorkerRuntime | None = None
    try:
        from engine.core.rpc.worker_server import make_worker_server
        from engine.core.startup import prepare
        from engine.core.worker.runtime import WorkerRuntime  # imports torch

        config = EngineConfig.model_validate_json(args.config_json)
        setup = prepare(config, process=f"worker {args.rank}")
        PluginManifest.from_json(args.manifest_json).verify(
            setup.catalog, process=f"worker rank {args.rank}")
        runtime = WorkerRuntime(setup, eos_token_id=args.eos_token_id, rank=args.rank,
                                world_size=args.world_size,
                                distributed_init_method=args.distributed_init_method)
        stop = threading.Event()
        server, bound = make_worker_server(runtime, args.address, executor=pool,
                                           shutdown_event=stop)
    except BaseException as exc:  # every start-up failure goes to EngineCore (logged)
        logger.exception("worker rank %d failed to start", args.rank)
        send_message(ready, error=describe_error(exc))
        ready.close()
        if runtime is not None:
            runtime.shutdown()
        pool.shutdown(wait=False)
        exit_process(1)
    assert runtime is not None
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    freeze_startup_heap()
    send_message(ready, ready=bound, num_available_blocks=runtime.num_available_blocks)
    ready.close()
    stop.wait()
    server.stop(STOP_GRACE_S).wait()
    pool.shutdown(wait=False, cancel_futures=True)
    runtime.shutdown()
    exit_process(0)
