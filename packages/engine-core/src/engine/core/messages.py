"""Every type that crosses the front end <-> EngineCore boundary, in one module.

The front end (``client/``, ``frontend/``, ``llm.py``), EngineCore (``engine/``) and the gRPC
layer (``rpc/``) all import these from here, so none of them imports another to learn a
type. Requests and per-request outputs are SDK data contracts (``EngineRequest``,
``EngineCoreOutput``, ``SchedulerStats``); what the engine adds around them is defined here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.sdk.scheduler import EngineCoreOutput
from engine.sdk.stats import SchedulerStats


class EngineDeadError(RuntimeError):
    """EngineCore stopped (crashed, was killed, a worker died, or it was shut down).

    No request can be served any more: the server answers 503 and fails in-flight requests
    with this message.
    """


class CollectiveRpcError(RuntimeError):
    """A ``collective_rpc`` call failed on at least one worker; the engine keeps serving.

    The message names the rank, the method and, for a worker extension, the plugin and its
    distribution.

    Attributes:
        method: The method that was called.
        rank: The first rank whose call failed (None when the call failed before any rank
            ran it, e.g. an unknown method or a timeout).
    """

    def __init__(self, message: str, *, method: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.method = method
        self.rank = rank


@dataclass(frozen=True)
class EngineInfo:
    """What the front end learns from EngineCore once it is up.

    Attributes:
        model_name: The model's display name.
        max_model_len: Longest prompt + output.
        num_kv_blocks: Usable KV blocks (per rank: every rank holds the same block count).
        block_size: Tokens per KV block.
        vocab_size: Logits columns.
        tensor_parallel_size: Worker ranks the model is split across.
        executor_backend: How the workers run: ``uni``, ``mp`` or ``ray``.
        extra_args_keys: The ``extra_args`` keys EngineCore's selected scheduler, scheduling
            policy and KV connector take, each with the plugins (as messages name them)
            that take it; the front end accepts them in requests.
    """

    model_name: str
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    vocab_size: int
    tensor_parallel_size: int = 1
    executor_backend: str = "uni"
    extra_args_keys: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


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


@dataclass(frozen=True)
class CollectiveRpcCall:
    """One ``collective_rpc`` as it travels from the front end to the workers.

    Attributes:
        method: A method of a selected worker extension.
        args: Positional arguments (JSON-serialisable when workers are other processes).
        kwargs: Keyword arguments (the same).
        timeout: Seconds to wait for every rank; None waits as long as it takes.
    """

    method: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] | None = None
    timeout: float | None = None
