"""``RayExecutor``: the workers as Ray actors (``--distributed-executor-backend ray``).

This is the multi-machine path, and it adds no cluster code of its own: with
``RAY_ADDRESS`` set (or a Ray instance already initialised in this process) the actors are
placed on that cluster; otherwise the engine starts a local Ray instance and stops it at
shutdown. Ray is an optional extra (``pip install 'engine-core[ray]'``) imported only
here, only when selected.

Each actor holds one rank's :class:`~engine.core.worker.runtime.WorkerRuntime`, built from
the same config and plugin manifest as a worker process (so an actor on a machine whose
plugins differ stops start-up with the difference). torch.distributed meets at rank 0's
node. A monitor thread pings every actor; an actor that dies is reported at once, as the
``mp`` executor reports a dead process.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import subprocess
import threading
import warnings
from collections.abc import Sequence
from typing import Any

from engine.core.cpu_threads import this_process, yielding_waits
from engine.core.executor.abstract import Executor, WorkerDiedError, rpc_error
from engine.core.startup import EngineSetup
from engine.sdk.scheduler import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger("engine.executor")

#: Seconds between health pings of every actor.
PING_INTERVAL_S = 0.5
#: How often a step waiting on the actors looks whether one died.
DEATH_POLL_S = 0.05
INSTALL_HINT = "pip install 'engine-core[ray]' (or pip install ray)"


def import_ray() -> Any:
    """``ray``, or an error that says how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise RuntimeError(f"--distributed-executor-backend ray needs Ray, which is not "
                           f"installed: {INSTALL_HINT}") from exc
    return ray


class RayWorker:
    """The actor: one rank's worker runtime (methods are called by :class:`RayExecutor`)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.runtime: Any = None

    def node_ip(self) -> str:
        """The address the other ranks reach this actor's node at."""
        import ray

        return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]

    def free_port(self) -> int:
        """A free TCP port on this actor's node (the rendezvous of rank 0)."""
        from engine.core.executor.mp import free_port

        return free_port()

    def start(self, config_json: str, manifest_json: str, eos_token_id: int | None,
              world_size: int, distributed_init_method: str | None) -> int:
        """Verify the plugins, join torch.distributed, load the shard; KV blocks it holds."""
        from engine.core.config import EngineConfig
        from engine.core.plugins import PluginManifest
        from engine.core.startup import prepare
        from engine.core.worker.runtime import WorkerRuntime

        logging.basicConfig(level=logging.INFO)
        setup = prepare(EngineConfig.model_validate_json(config_json),
                        process=f"ray worker {self.rank}")
        PluginManifest.from_json(manifest_json).verify(
            setup.catalog, process=f"Ray worker rank {self.rank}")
        self.runtime = WorkerRuntime(setup, eos_token_id=eos_token_id, rank=self.rank,
                                     world_size=world_size,
                                     distributed_init_method=distributed_init_method)
        return int(self.runtime.num_available_blocks)

    def initialize_cache(self, num_blocks: int) -> None:
        self.runtime.initialize_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        output: ModelRunnerOutput = self.runtime.execute_model(scheduler_output)
        return output if self.rank == 0 else None  # only the driver's tokens travel back

    def collective_rpc(self, method: str, args: Sequence[Any],
                       kwargs: dict[str, Any]) -> Any:
        return self.runtime.collective_rpc(method, args, kwargs)

    def ping(self) -> bool:
        return True

    def shutdown(self) -> None:
        if self.runtime is not None:
            self.runtime.shutdown()


#: What Ray says when its own processes did not come up within its fixed wait.
RAY_START_TIMEOUTS = ("timed out during startup", "Timed out waiting for file")


def _forget_killed_processes() -> None:
    """Stop and collect the processes a failed ``ray.init`` started.

    The failed start's node never became Ray's global node, so ``ray.shutdown`` may leave
    its GCS and raylet running, and each ``Popen`` object would warn "subprocess N is still
    running" whenever the garbage collector happened to reach it (wherever a reference
    kept it: collecting alone did not always get there first). Each such process still
    running is killed and waited for, which also sets its return code.
    """
    for obj in gc.get_objects():  # type(), not isinstance: no object's __class__ runs
        if (issubclass(type(obj), subprocess.Popen) and obj.returncode is None
                and "ray" in str(obj.args)):
            with contextlib.suppress(OSError):
                obj.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                obj.wait(timeout=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


def is_ray_start_timeout(exc: BaseException) -> bool:
    """True when ``ray.init`` failed because Ray's processes started too slowly."""
    return any(text in str(exc) for text in RAY_START_TIMEOUTS)


class RayExecutor(Executor):
    """The ``ray`` executor (see the module docstring).

    Raises:
        RuntimeError: Ray is not installed, or an actor failed to start (naming its rank).
    """

    backend = "ray"

    def __init__(self, setup: EngineSetup, *, eos_token_id: int | None) -> None:
        super().__init__(world_size=setup.config.tensor_parallel_size)
        self.ray = ray = import_ray()
        self._closing = False
        self._started_ray = False
        self.actors: list[Any] = []
        self._stop = threading.Event()
        try:
            self._init_ray()
            options: dict[str, Any] = {"num_cpus": 1, "max_concurrency": 2}
            if setup.platform.device_type == "cuda":
                options["num_gpus"] = 1
            actor_cls = ray.remote(RayWorker)
            self.actors = [actor_cls.options(**options).remote(rank)
                           for rank in range(self.world_size)]
            init_method = None
            if self.world_size > 1:
                ip, port = ray.get([self.actors[0].node_ip.remote(),
                                    self.actors[0].free_port.remote()])
                init_method = f"tcp://{ip}:{port}"
            refs = [actor.start.remote(setup.config.model_dump_json(),
                                       setup.manifest.to_json(), eos_token_id,
                                       self.world_size, init_method)
                    for actor in self.actors]
            blocks = [self._get(rank, ref, starting=True) for rank, ref in enumerate(refs)]
            self.num_blocks = min(blocks)
            ray.get([actor.initialize_cache.remote(self.num_blocks) for actor in self.actors])
        except BaseException:
            self.shutdown()
            raise
        self._monitor = threading.Thread(target=self._watch, name="engine-ray-monitor",
                                         daemon=True)
        self._monitor.start()
        logger.info("%d Ray worker actor(s) ready, %d KV blocks each", self.world_size,
                    self.num_blocks)

    def _init_ray(self) -> None:
        ray = self.ray
        if ray.is_initialized():
            return
        address = os.environ.get("RAY_ADDRESS")
        if address:
            logger.info("joining the Ray cluster at %s", address)
            ray.init(address=address, log_to_driver=True)
        else:
            cpus = max(this_process().num_cpus, self.world_size)
            logger.info("starting a local Ray instance (%d CPUs)", cpus)
            self._started_ray = True  # also when init fails half-way: shutdown() cleans up
            for attempt in (1, 2):
                # No automatic collection until a failed start's processes are reaped: one
                # run while the failure unwinds would reach the Popen objects of processes
                # still running first (each warning "subprocess N is still running", seen
                # in CI) and leave those processes to nobody.
                collecting = gc.isenabled()
                gc.disable()
                try:
                    if self._start_local_ray(cpus, last=attempt == 2):
                        return
                    ray.shutdown()
                    _forget_killed_processes()
                finally:
                    if collecting:
                        gc.enable()

    def _start_local_ray(self, cpus: int, *, last: bool) -> bool:
        """``ray.init`` of a local instance; whether it started.

        False when it timed out and may be tried again (not ``last``); raises anything else.
        """
        try:
            with yielding_waits():  # Ray's worker processes inherit its environment
                self.ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=True)
            return True
        except Exception as exc:  # Ray raises a bare Exception for some of these
            if last or not is_ray_start_timeout(exc):
                raise
            # Ray waits a fixed time for its GCS and raylet processes (15-30 s); on a loaded
            # machine a start can miss that. A second start is cheap. str(exc): a log
            # record holding the exception would keep its frames, and through them Ray's
            # Popen objects, alive past the caller's reaping.
            logger.warning("the local Ray instance did not start in time (%s); starting it "
                           "once more", str(exc))
            return False

    def _get(self, rank: int, ref: Any, *, starting: bool = False) -> Any:
        """``ray.get(ref)``, raising a death as soon as it is seen, naming the rank."""
        ray = self.ray
        while True:
            if self.failure is not None:
                raise self.failure
            try:
                return ray.get(ref, timeout=DEATH_POLL_S)
            except ray.exceptions.GetTimeoutError:
                continue
            except ray.exceptions.RayActorError as exc:
                error = WorkerDiedError(f"Ray worker rank {rank} died: {exc}", rank=rank)
                if starting:
                    raise RuntimeError(f"Ray worker rank {rank} failed to start: {exc}") from exc
                self._report_failure(error)
                raise error from exc
            except ray.exceptions.RayTaskError as exc:
                if starting:
                    cause = exc.cause if getattr(exc, "cause", None) is not None else exc
                    raise RuntimeError(f"Ray worker rank {rank} failed to start: "
                                       f"{type(cause).__name__}: {cause}") from exc
                raise

    def _watch(self) -> None:
        ray = self.ray
        while not self._stop.wait(PING_INTERVAL_S):
            for rank, actor in enumerate(self.actors):
                try:
                    ray.get(actor.ping.remote(), timeout=5)
                except ray.exceptions.RayActorError as exc:
                    if not self._closing:
                        self._report_failure(WorkerDiedError(
                            f"Ray worker rank {rank} died: {exc}", rank=rank))
                    return
                except Exception:  # noqa: BLE001 - a slow ping is not a death
                    continue

    def check_health(self) -> None:
        if self.failure is not None:
            raise self.failure

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.check_health()
        payload = self.ray.put(scheduler_output)  # serialised once for every actor
        refs = [actor.execute_model.remote(payload) for actor in self.actors]
        outputs = [self._get(rank, ref) for rank, ref in enumerate(refs)]
        output: ModelRunnerOutput = outputs[0]
        return output

    def collective_rpc(self, method: str, args: Sequence[Any] = (),
                       kwargs: dict[str, Any] | None = None,
                       timeout: float | None = None) -> list[Any]:
        from engine.core.messages import CollectiveRpcError

        ray = self.ray
        self.check_health()
        refs = [actor.collective_rpc.remote(method, list(args), kwargs or {})
                for actor in self.actors]
        results = []
        for rank, ref in enumerate(refs):
            try:
                results.append(ray.get(ref, timeout=timeout))
            except ray.exceptions.GetTimeoutError:
                raise CollectiveRpcError(f"collective_rpc {method!r}: Ray worker rank {rank} "
                                         f"did not answer within {timeout:g} s",
                                         method=method, rank=rank) from None
            except ray.exceptions.RayTaskError as exc:
                cause = exc.cause if getattr(exc, "cause", None) is not None else exc
                raise rpc_error(method, rank, str(cause),
                                plugin=getattr(cause, "plugin", None)) from exc
        return results

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._stop.set()
        ray = self.ray
        if self.actors:
            try:
                ray.get([actor.shutdown.remote() for actor in self.actors], timeout=5)
            except Exception:  # noqa: BLE001 - killed below either way
                pass
            for actor in self.actors:
                try:
                    ray.kill(actor)
                except Exception:  # noqa: BLE001 - already gone
                    pass
        if self._started_ray:
            try:
                ray.shutdown()
            except Exception:
                logger.exception("stopping the local Ray instance failed")
