"""``WorkerRuntime``: one rank's worker as every executor drives it.

The same object serves the ``uni`` executor (called directly inside EngineCore), a worker
process of the ``mp`` executor (behind ``proto/engine/v1/worker.proto``) and a Ray actor.
It builds the worker class with the selected worker extensions, and gives the executors
one protocol::

    runtime = WorkerRuntime(setup, eos_token_id=..., rank=r, world_size=n,
                            distributed_init_method="tcp://host:port")  # loads the model
    runtime.num_available_blocks          # what this rank can hold; the executor takes the min
    runtime.initialize_cache(num_blocks)  # allocate, then init_worker_extension()
    runtime.execute_model(scheduler_output) -> ModelRunnerOutput   (rank 0's is the real one)
    runtime.collective_rpc(method, args, kwargs) -> result
    runtime.shutdown()
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from engine.core.startup import EngineSetup
from engine.core.worker.extensions import (
    ExtensionMethods,
    load_worker_extensions,
    worker_class,
)
from engine.core.worker.worker import Worker
from engine.sdk.scheduler import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger("engine.worker")


class WorkerRuntime:
    """One rank's worker with its extensions (see the module docstring).

    Raises:
        PluginError: a selected extension cannot be loaded or clashes (naming both).
    """

    def __init__(self, setup: EngineSetup, *, eos_token_id: int | None, rank: int = 0,
                 world_size: int = 1, distributed_init_method: str | None = None) -> None:
        extensions = load_worker_extensions(setup.catalog, setup.worker_extensions)
        self.methods = ExtensionMethods(extensions)
        cls = worker_class(Worker, extensions)
        self.rank = rank
        self.world_size = world_size
        self.worker: Any = cls(setup, eos_token_id=eos_token_id, rank=rank,
                               world_size=world_size,
                               distributed_init_method=distributed_init_method)
        self._started = False
        self._closed = False

    @property
    def num_available_blocks(self) -> int:
        """KV blocks (null block included) this rank can hold."""
        return int(self.worker.num_available_blocks)

    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` KV blocks, start the extensions, capture the forward pass."""
        self.worker.initialize_cache(num_blocks)
        self.methods.run_hook(self.worker, "init_worker_extension")
        self._started = True
        self.worker.capture_step_graph()
        self.worker.prefault_kv_cache()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One step on this rank."""
        output: ModelRunnerOutput = self.worker.execute_model(scheduler_output)
        return output

    def collective_rpc(self, method: str, args: Sequence[Any] = (),
                       kwargs: Mapping[str, Any] | None = None) -> Any:
        """Call an extension method on this rank's worker.

        Raises:
            WorkerExtensionError: unknown method, or the method raised, naming the extension.
        """
        try:
            return self.methods.call(self.worker, method, args, kwargs or {})
        finally:  # the method may have changed the model: record its forward pass anew
            self.worker.capture_step_graph(again=True)

    def check_health(self) -> None:
        """Raises if this worker cannot serve (it has been shut down)."""
        if self._closed:
            raise RuntimeError(f"worker rank {self.rank} has been shut down")

    def shutdown(self) -> None:
        """Stop the extensions and the worker (idempotent; errors are logged)."""
        if self._closed:
            return
        self._closed = True
        if self._started:
            try:
                self.methods.run_hook(self.worker, "destroy_worker_extension")
            except Exception:
                logger.exception("worker rank %d: stopping its extensions failed", self.rank)
        try:
            self.worker.shutdown()
        except Exception:
            logger.exception("worker rank %d: shutdown failed", self.rank)
