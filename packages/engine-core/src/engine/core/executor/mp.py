"""``MultiprocExecutor``: one spawned worker process per tensor-parallel rank.

::

    EngineCore process                               worker process, rank r (x N)
    ------------------                               ----------------------------
    spawn N (multiprocessing "spawn")  ------------>  prepare(); verify the manifest
    wait: every rank's {"ready", num_available_blocks} <- torch.distributed rendezvous,
                                                        load the shard, serve worker.proto
    InitializeCache(min over ranks)     ------------>  allocate, init extensions
    per step: the SchedulerOutput, encoded once,       execute_model on every rank;
      sent to every rank in parallel    ------------>  rank 0 answers with the tokens
    a monitor thread waits on every process sentinel: a death is reported at once

Sockets live in a fresh 0700 directory (removed at shutdown); torch.distributed meets on
``tcp://127.0.0.1:PORT``. Worker processes exit on their own within ~0.2 s if EngineCore
dies; :meth:`MultiprocExecutor.shutdown` stops them, kills what does not stop, and reaps
every process.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import multiprocessing
import os
import shutil
import socket
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from engine.core.cpu_threads import yielding_waits
from engine.core.executor.abstract import Executor, WorkerDiedError, rpc_error
from engine.core.messages import CollectiveRpcError
from engine.core.rpc.launch import describe_exit, make_socket_dir
from engine.core.startup import EngineSetup
from engine.core.worker.process import WorkerProcessArgs, run_worker_process
from engine.sdk.scheduler import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger("engine.executor")

#: Seconds the workers get to load the model and report ready.
STARTUP_TIMEOUT_S = float(os.environ.get("ENGINE_WORKER_STARTUP_TIMEOUT", "600"))
#: Seconds a worker gets to exit after Shutdown before it is killed.
STOP_TIMEOUT_S = 2.0
#: How often a step waiting on the workers looks whether one died.
DEATH_POLL_S = 0.05
#: How long a broken channel waits for the monitor to report the process's exit.
DEATH_REPORT_S = 2.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for the torch.distributed rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class MultiprocExecutor(Executor):
    """The ``mp`` executor (see the module docstring).

    Raises:
        RuntimeError: a worker failed to start (its error, naming the rank) or did not
            report ready within ``ENGINE_WORKER_STARTUP_TIMEOUT`` seconds (default 600).
    """

    backend = "mp"

    def __init__(self, setup: EngineSetup, *, eos_token_id: int | None) -> None:
        super().__init__(world_size=setup.config.tensor_parallel_size)
        self._closing = False
        self._socket_dir = make_socket_dir()
        self.processes: list[BaseProcess] = []
        self.clients: list[Any] = []
        self._stop_r, self._stop_w = multiprocessing.Pipe(duplex=False)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.world_size, thread_name_prefix="engine-collective-rpc")
        try:
            addresses, blocks = self._spawn(setup, eos_token_id)
            from engine.core.rpc.worker_client import WorkerClient

            self.clients = [WorkerClient(address, rank=rank)
                            for rank, address in enumerate(addresses)]
            self.num_blocks = min(blocks)
            for future in [self._pool.submit(c.initialize_cache, self.num_blocks)
                           for c in self.clients]:
                future.result()
        except BaseException:
            self.shutdown()
            raise
        self._monitor = threading.Thread(target=self._watch, name="engine-worker-monitor",
                                         daemon=True)
        self._monitor.start()
        logger.info("%d worker process(es) ready (pids %s), %d KV blocks each",
                    self.world_size, ", ".join(str(p.pid) for p in self.processes),
                    self.num_blocks)

    # -- start-up ------------------------------------------------------------------------

    def _spawn(self, setup: EngineSetup, eos_token_id: int | None,
               ) -> tuple[list[str], list[int]]:
        context = multiprocessing.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{free_port()}" if self.world_size > 1 else None
        readers: list[Connection] = []
        for rank in range(self.world_size):
            reader, writer = context.Pipe(duplex=False)
            args = WorkerProcessArgs(
                config_json=setup.config.model_dump_json(),
                manifest_json=setup.manifest.to_json(), eos_token_id=eos_token_id,
                rank=rank, world_size=self.world_size, distributed_init_method=init_method,
                address=f"unix:{os.path.join(self._socket_dir, f'worker-{rank}.sock')}",
                log_level=logging.getLogger("engine").getEffectiveLevel(),
            )
            process = context.Process(target=run_worker_process, args=(args, writer),
                                      name=f"EngineWorker-{rank}", daemon=False)
            with yielding_waits():  # inherited from EngineCore, unless it runs in process
                process.start()
            writer.close()
            self.processes.append(process)
            readers.append(reader)
        return self._wait_ready(readers)

    def _wait_ready(self, readers: list[Connection]) -> tuple[list[str], list[int]]:
        messages: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(messages) < self.world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(self.world_size)) - set(messages))
                raise RuntimeError(f"worker rank(s) {missing} did not start within "
                                   f"{STARTUP_TIMEOUT_S:g} s (ENGINE_WORKER_STARTUP_TIMEOUT)")
            waiting = {r: readers[r] for r in range(self.world_size) if r not in messages}
            sentinels = {self.processes[r].sentinel: r for r in waiting}
            ready = wait([*waiting.values(), *sentinels], timeout=left)
            for item in ready:
                rank = sentinels.get(item) if isinstance(item, int) else None
                if rank is None:
                    rank = next(r for r, conn in waiting.items() if conn is item)
                messages[rank] = self._read_ready(rank, readers[rank])
                if "error" in messages[rank]:
                    raise RuntimeError(f"worker rank {rank} failed to start: "
                                       f"{messages[rank]['error']}")
        for reader in readers:
            reader.close()
        return ([messages[r]["ready"] for r in range(self.world_size)],
                [int(messages[r]["num_available_blocks"]) for r in range(self.world_size)])

    def _read_ready(self, rank: int, reader: Connection) -> dict[str, Any]:
        try:
            if reader.poll(0.5):
                message: dict[str, Any] = json.loads(reader.recv_bytes())
                return message
        except (EOFError, OSError):
            pass
        process = self.processes[rank]
        process.join(5)
        return {"error": f"the process exited ({describe_exit(process.exitcode)}) before it "
                         f"was ready; its traceback is on stderr above"}

    # -- watching ------------------------------------------------------------------------

    def _watch(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.processes)}
        ready = wait([*sentinels, self._stop_r])
        if self._closing or self._stop_r in ready:
            return
        rank = next(sentinels[s] for s in ready if isinstance(s, int) and s in sentinels)
        self._report_failure(self._died(rank))

    def _died(self, rank: int) -> WorkerDiedError:
        process = self.processes[rank]
        process.join(1)
        return WorkerDiedError(f"worker rank {rank} (pid {process.pid}) died: "
                               f"{describe_exit(process.exitcode)}", rank=rank)

    def check_health(self) -> None:
        # The monitor thread sees every exit at once (and alone reaps the processes: a
        # second waitpid from another thread would race it).
        if self.failure is not None:
            raise self.failure

    # -- steps ---------------------------------------------------------------------------

    def _result(self, rank: int, future: Any, *, decode: bool = True) -> Any:
        """``future.result()`` (``check()`` without ``decode``), raising a death at once."""
        from engine.core.rpc.worker_client import WorkerUnavailableError

        while True:
            if self.failure is not None:
                future.cancel()
                raise self.failure
            try:
                if decode:
                    return future.result(timeout=DEATH_POLL_S)
                return future.check(timeout=DEATH_POLL_S)
            except (concurrent.futures.TimeoutError, TimeoutError):
                continue
            except WorkerUnavailableError:
                # The channel broke: the monitor, which alone reaps the processes, reports
                # a death within milliseconds.
                failure = self.wait_for_failure(DEATH_REPORT_S)
                raise failure or WorkerDiedError(
                    f"worker rank {rank} (pid {self.processes[rank].pid}) stopped answering "
                    f"but is still running", rank=rank) from None

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        from engine.core.rpc.worker_client import encode_scheduler_output

        self.check_health()
        payload = encode_scheduler_output(scheduler_output)
        futures = [client.execute_model_future(payload) for client in self.clients]
        for rank in range(1, len(futures)):  # only rank 0's tokens are decoded
            self._result(rank, futures[rank], decode=False)
        output: ModelRunnerOutput = self._result(0, futures[0])
        return output

    def collective_rpc(self, method: str, args: Sequence[Any] = (),
                       kwargs: dict[str, Any] | None = None,
                       timeout: float | None = None) -> list[Any]:
        from engine.core.rpc.worker_client import WorkerCallError

        self.check_health()
        try:
            json.dumps([list(args), kwargs or {}])
        except (TypeError, ValueError) as exc:
            raise CollectiveRpcError(
                f"collective_rpc {method!r}: arguments must be JSON-serialisable to reach "
                f"worker processes ({exc})", method=method) from None
        futures = [self._pool.submit(client.collective_rpc, method, list(args),
                                     kwargs or {}, timeout) for client in self.clients]
        results = []
        deadline = None if timeout is None else time.monotonic() + timeout
        for rank, future in enumerate(futures):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                results.append(future.result(left))
            except (concurrent.futures.TimeoutError, TimeoutError):
                raise CollectiveRpcError(f"collective_rpc {method!r}: worker rank {rank} did "
                                         f"not answer within {timeout:g} s",
                                         method=method, rank=rank) from None
            except WorkerCallError as exc:
                raise rpc_error(method, rank, exc.message, plugin=exc.plugin) from exc
        return results

    # -- shutdown ------------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        with_clients = list(self.clients)
        for client in with_clients:
            try:
                client.shutdown()
            except Exception:  # noqa: BLE001 - stopping anyway; killed below if it hangs
                pass
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                logger.warning("worker %s (pid %s) did not stop; killing it", process.name,
                               process.pid)
                process.kill()
                process.join(5)
        for client in with_clients:
            client.close()
        try:
            self._stop_w.send_bytes(b"stop")
        except OSError:
            pass
        self._pool.shutdown(wait=False, cancel_futures=True)
        shutil.rmtree(self._socket_dir, ignore_errors=True)
