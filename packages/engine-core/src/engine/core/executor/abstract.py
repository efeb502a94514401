"""``Executor``: how EngineCore runs its workers, whatever they are.

One interface, three implementations (``--distributed-executor-backend``):

* ``uni``: one worker inside the EngineCore process, called directly (default for one
  rank);
* ``mp``: one spawned process per tensor-parallel rank, each serving
  ``proto/engine/v1/worker.proto`` on a private unix socket (default for more ranks);
* ``ray``: the same workers as Ray actors, on a local Ray instance or the cluster named by
  ``RAY_ADDRESS`` (the multi-machine path).

Every rank receives every ``SchedulerOutput``; rank 0 (the driver) returns the sampled
tokens. A worker that dies is reported to the failure callbacks (the busy loop stops with
an error naming the rank) and makes the step in flight raise :class:`WorkerDiedError`.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from engine.core.messages import CollectiveRpcError, EngineDeadError
from engine.sdk.scheduler import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger("engine.executor")

FailureCallback = Callable[[BaseException], None]


class WorkerDiedError(EngineDeadError):
    """A worker process or actor is gone; the engine cannot serve any more.

    Attributes:
        rank: The tensor-parallel rank of the worker.
    """

    def __init__(self, message: str, *, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class Executor(ABC):
    """Runs the workers of one engine (see the module docstring).

    Attributes:
        world_size: Number of tensor-parallel ranks.
        num_blocks: KV blocks every rank allocated (null block included): the smallest
            number any rank could hold.
    """

    #: The ``--distributed-executor-backend`` value of this executor.
    backend: str = ""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.num_blocks = 0
        self._failure_callbacks: list[FailureCallback] = []
        self._failure: BaseException | None = None
        self._failure_lock = threading.Lock()
        self._failed = threading.Event()

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; rank 0's output.

        Raises:
            WorkerDiedError: a worker died before or during the step.
        """

    @abstractmethod
    def collective_rpc(self, method: str, args: Sequence[Any] = (),
                       kwargs: dict[str, Any] | None = None,
                       timeout: float | None = None) -> list[Any]:
        """Call worker-extension ``method`` on every rank; results in rank order.

        Raises:
            CollectiveRpcError: unknown method, an exception on a rank (naming the rank, the
                extension and its distribution), or no answer within ``timeout`` seconds.
            WorkerDiedError: a worker is gone.
        """

    @abstractmethod
    def check_health(self) -> None:
        """Raises :class:`WorkerDiedError` when a worker is gone."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every worker and wait for it (idempotent; no process is left behind)."""

    # -- failure reporting ---------------------------------------------------------------

    def register_failure_callback(self, callback: FailureCallback) -> None:
        """Call ``callback(error)`` once if a worker dies (from the watching thread)."""
        with self._failure_lock:
            failure = self._failure
            if failure is None:
                self._failure_callbacks.append(callback)
        if failure is not None:
            callback(failure)

    def _report_failure(self, error: BaseException) -> None:
        """Record the first failure and tell the callbacks (any thread)."""
        with self._failure_lock:
            if self._failure is not None:
                return
            self._failure = error
            self._failed.set()
            callbacks = list(self._failure_callbacks)
        logger.error("%s", error)
        for callback in callbacks:
            try:
                callback(error)
            except Exception:
                logger.exception("a worker-failure callback raised")

    @property
    def failure(self) -> BaseException | None:
        """The first worker failure, or None."""
        return self._failure

    def wait_for_failure(self, timeout: float) -> BaseException | None:
        """The first worker failure, waiting up to ``timeout`` s for one to be reported."""
        self._failed.wait(timeout)
        return self._failure


def rpc_error(method: str, rank: int, message: str, *,
              plugin: str | None) -> CollectiveRpcError:
    """The caller's error for ``method`` failing on ``rank`` with the worker's ``message``.

    Without a ``plugin`` the call reached no extension method (an unknown name): the same
    on every rank, so no rank is named.
    """
    if plugin is None:
        return CollectiveRpcError(f"collective_rpc {method!r}: {message}", method=method)
    return CollectiveRpcError(f"collective_rpc {method!r} failed on worker rank {rank}: "
                              f"{message}", method=method, rank=rank)
