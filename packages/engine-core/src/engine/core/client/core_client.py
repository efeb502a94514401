"""``EngineCoreClient``: how the front end talks to EngineCore, whatever the transport.

Two implementations share this interface:

* ``InProcessCoreClient`` (``--in-process``): EngineCore runs on a thread of this process;
  calls are direct. Tests and debuggers reach every seam (exceptions land in the caller).
* ``GrpcCoreClient`` (default for ``engine serve``): EngineCore runs in its own process
  (spawned) behind ``proto/engine/v1/engine_core.proto``; one long-lived bidirectional
  stream carries requests in and batched per-step outputs out.

The front end (``AsyncLLM``) owns tokenization, detokenization and stop strings; the core
client only moves ``EngineRequest``s in and ``StepOutputs`` out.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from typing import Any

from engine.core.messages import EngineDeadError, EngineInfo, StepOutputs
from engine.sdk.scheduler import EngineRequest, RequestStatus
from engine.sdk.stats import SchedulerStats

__all__ = ["EngineCoreClient", "EngineDeadError", "EngineInfo", "StepOutputs"]


class EngineCoreClient(ABC):
    """Transport between the front end and EngineCore (see the module docstring)."""

    @abstractmethod
    async def start(self) -> EngineInfo:
        """Start (or connect to) EngineCore; returns once it can take requests.

        Raises:
            EngineDeadError: EngineCore failed to start, with its error.
        """

    @abstractmethod
    def add_requests(self, requests: Sequence[EngineRequest]) -> None:
        """Queue requests (non-blocking). Raises ``EngineDeadError`` if EngineCore is gone."""

    @abstractmethod
    def abort_requests(self, request_ids: Sequence[str]) -> None:
        """End requests now and free their blocks (non-blocking; unknown ids ignored)."""

    @abstractmethod
    def finish_requests(self, request_ids: Sequence[str], status: RequestStatus) -> None:
        """End requests with ``status`` (stop strings found by the front end)."""

    @abstractmethod
    def outputs(self) -> AsyncIterator[StepOutputs]:
        """Step outputs as EngineCore produces them; ends with ``EngineDeadError`` if it dies."""

    @abstractmethod
    async def is_healthy(self) -> bool:
        """True while EngineCore is alive and stepping."""

    @abstractmethod
    async def get_stats(self) -> SchedulerStats:
        """The scheduler's current stats."""

    @abstractmethod
    async def reset_prefix_cache(self) -> bool:
        """Drop cached blocks not in use; False if some blocks are in use."""

    @abstractmethod
    async def collective_rpc(self, method: str, args: Sequence[Any] = (),
                             kwargs: dict[str, Any] | None = None,
                             timeout: float | None = None) -> list[Any]:
        """Call ``method`` of the worker extensions on every worker; one result per rank.

        Raises:
            CollectiveRpcError: the method is unknown, raised on a rank, or timed out.
            EngineDeadError: EngineCore is gone.
        """

    @abstractmethod
    async def shutdown(self) -> None:
        """Stop EngineCore (in-flight requests are aborted); idempotent."""

    @property
    @abstractmethod
    def dead_error(self) -> EngineDeadError | None:
        """Why EngineCore is gone, or None while it runs."""
