"""Executors: how EngineCore runs its workers (``--distributed-executor-backend``)."""

from __future__ import annotations

from engine.core.executor.abstract import Executor, WorkerDiedError
from engine.core.startup import EngineSetup

__all__ = ["Executor", "WorkerDiedError", "make_executor"]


def make_executor(setup: EngineSetup, *, eos_token_id: int | None) -> Executor:
    """The executor the config selects, with its workers loaded and their caches allocated.

    Ray is imported only when ``ray`` is selected.
    """
    backend = setup.config.executor_backend
    if backend == "uni":
        from engine.core.executor.uni import UniExecutor

        return UniExecutor(setup, eos_token_id=eos_token_id)
    if backend == "mp":
        from engine.core.executor.mp import MultiprocExecutor

        return MultiprocExecutor(setup, eos_token_id=eos_token_id)
    from engine.core.executor.ray_executor import RayExecutor

    return RayExecutor(setup, eos_token_id=eos_token_id)
