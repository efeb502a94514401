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
from dataclasses import dataclass

from engine.sdk.scheduler import EngineCoreOutput, EngineRequest, RequestStatus
from engine.sdk.stats import SchedulerStats


class EngineDeadError(RuntimeError):
    """EngineCore stopped (crashed, was killed, or shut down): no request can be served.

    The server answers 503 and fails in-flight requests with this message.
    """


@dataclass(frozen=True)
class EngineInfo:
    """What the front end learns from EngineCore once it is up.

    Attributes:
        model_name: The model's display name.
        max_model_len: Longest prompt + output.
        num_kv_blocks: Usable KV blocks.
        block_size: Tokens per KV block.
        vocab_size: Logits columns.
    """

    model_name: str
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    vocab_size: int


@dataclass(frozen=True)
class StepOutputs:
    """The outputs of one engine step, delivered together (never one message per token).

    Attributes:
        outputs: Per-request results of the step.
        scheduler_stats: The scheduler's state after the step.
        timestamp: ``time.time()`` when the step finished, in EngineCore.
    """

    outputs: Sequence[EngineCoreOutput] = ()
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0


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
    async def shutdown(self) -> None:
        """Stop EngineCore (in-flight requests are aborted); idempotent."""

    @property
    @abstractmethod
    def dead_error(self) -> EngineDeadError | None:
        """Why EngineCore is gone, or None while it runs."""
