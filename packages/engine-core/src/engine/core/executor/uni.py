"""``UniExecutor``: one worker inside the EngineCore process, called directly.

No process, no copy, no serialisation: today's single-rank speed. ``collective_rpc``
calls the extension method in place (its ``timeout`` cannot interrupt it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.core.executor.abstract import Executor, rpc_error
from engine.core.startup import EngineSetup
from engine.core.worker.extensions import WorkerExtensionError
from engine.core.worker.runtime import WorkerRuntime
from engine.sdk.scheduler import ModelRunnerOutput, SchedulerOutput


class UniExecutor(Executor):
    """The ``uni`` executor (see the module docstring)."""

    backend = "uni"

    def __init__(self, setup: EngineSetup, *, eos_token_id: int | None) -> None:
        super().__init__(world_size=1)
        self.runtime = WorkerRuntime(setup, eos_token_id=eos_token_id)
        try:
            self.runtime.initialize_cache(self.runtime.num_available_blocks)
        except BaseException:
            self.runtime.shutdown()
            raise
        self.num_blocks = self.runtime.num_available_blocks

    @property
    def worker(self) -> Any:
        """The worker (model, KV cache, runner), for tests and debuggers."""
        return self.runtime.worker

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runtime.execute_model(scheduler_output)

    def collective_rpc(self, method: str, args: Sequence[Any] = (),
                       kwargs: dict[str, Any] | None = None,
                       timeout: float | None = None) -> list[Any]:
        try:
            return [self.runtime.collective_rpc(method, args, kwargs)]
        except WorkerExtensionError as exc:
            raise rpc_error(method, 0, str(exc), plugin=exc.plugin) from exc

    def check_health(self) -> None:
        self.runtime.check_health()

    def shutdown(self) -> None:
        self.runtime.shutdown()
