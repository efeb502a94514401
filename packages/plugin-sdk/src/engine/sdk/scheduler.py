"""The scheduler contract: what EngineCore asks a scheduler, and the data it exchanges.

``SchedulerInterface`` is the whole scheduler (a replacement is registered in
``engine.schedulers`` and chosen with ``--scheduler NAME``). For ordering, admission and
preemption decisions alone, write a :class:`~engine.sdk.scheduling_policy.SchedulingPolicy`
instead: it is smaller and plugs into the default scheduler.

One engine step, on the EngineCore thread::

    out = scheduler.schedule()                     # exactly once per forward pass
    runner_out = executor.execute_model(out)       # workers run the model and sample
    core_outs = scheduler.update_from_output(out, runner_out)
    # add_request / finish_requests only happen here, between steps

``SchedulerOutput`` and ``ModelRunnerOutput`` cross process boundaries: they hold only
plain values (ints, strings, tuples, SDK dataclasses).

.. versionadded:: 1.0
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from engine.sdk.context import PluginContext
from engine.sdk.errors import PluginFailure
from engine.sdk.plugin import Plugin
from engine.sdk.sampling_params import SamplingParams
from engine.sdk.structured_output import GrammarBitmask

if TYPE_CHECKING:
    from engine.sdk.kv_connector import KVConnectorScheduler
    from engine.sdk.scheduling_policy import SchedulingPolicy
    from engine.sdk.stats import SchedulerStats


class RequestStatus(enum.Enum):
    """Where a request is in its life. ``FINISHED_*`` states are final.

    .. versionadded:: 1.0
    """

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH_CAPPED = "finished_length_capped"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"
    """A plugin failed while serving the request (see :class:`~engine.sdk.errors.PluginFailure`).

    .. versionadded:: 1.1
    """

    @property
    def is_finished(self) -> bool:
        """True for the ``FINISHED_*`` states."""
        return self.name.startswith("FINISHED")

    @property
    def finish_reason(self) -> str | None:
        """The finish reason (``stop``, ``length``, ``abort``, ``error``); None if unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(frozen=True)
class EngineRequest:
    """A request as EngineCore receives it from the front end (already validated, tokenized).

    Attributes:
        request_id: Unique id of this sequence (the front end derives one per choice when n > 1).
        prompt_token_ids: The prompt.
        sampling_params: How to sample; ``n`` is always 1 here.
        eos_token_id: The tokenizer's EOS id (``None`` if it has none).
        arrival_time: ``time.time()`` when the front end received the request.
        priority: Lower values are scheduled first by the ``priority`` policy.

    .. versionadded:: 1.0
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    priority: int = 0


@runtime_checkable
class RequestView(Protocol):
    """Read-only view of a request inside the scheduler, as policies and connectors see it.

    The engine's own request objects satisfy this protocol; never mutate them.

    .. versionadded:: 1.0
    """

    @property
    def request_id(self) -> str:
        """Unique id."""
    @property
    def prompt_token_ids(self) -> Sequence[int]:
        """The prompt."""
    @property
    def output_token_ids(self) -> Sequence[int]:
        """Tokens generated so far (grows every step)."""
    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length."""
    @property
    def num_tokens(self) -> int:
        """Prompt plus output length."""
    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV is in the cache."""
    @property
    def sampling_params(self) -> SamplingParams:
        """How the request samples."""
    @property
    def priority(self) -> int:
        """Lower is more urgent (``priority`` policy)."""
    @property
    def arrival_time(self) -> float:
        """``time.time()`` at arrival in the front end."""
    @property
    def status(self) -> RequestStatus:
        """Where the request is in its life."""


@dataclass(frozen=True)
class NewRequestData:
    """A request the workers have not seen yet (first schedule, or resumed after preemption).

    Attributes:
        req_id: The request id.
        prompt_token_ids: The full prompt.
        output_token_ids: Tokens generated before a preemption (empty for a new request);
            the worker treats them as part of the sequence and as prior output for penalties.
        sampling_params: How to sample.
        block_ids: KV-cache blocks holding the sequence, in order.
        num_computed_tokens: Tokens whose KV is already in those blocks (prefix-cache hits).

    .. versionadded:: 1.0
    """

    req_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    block_ids: tuple[int, ...]
    num_computed_tokens: int
    output_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class CachedRequestData:
    """Per-step deltas for requests the workers already hold, as parallel tuples.

    Attributes:
        req_ids: The requests scheduled again this step.
        new_block_ids: Blocks appended to each request's block table since its last step.
        num_computed_tokens: Each request's computed tokens at the start of this step.

    .. versionadded:: 1.0
    """

    req_ids: tuple[str, ...] = ()
    new_block_ids: tuple[tuple[int, ...], ...] = ()
    num_computed_tokens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not len(self.req_ids) == len(self.new_block_ids) == len(self.num_computed_tokens):
            raise ValueError("CachedRequestData fields must have one entry per request id")


@dataclass(frozen=True)
class SchedulerOutput:
    """What to run in one forward pass: the output of :meth:`SchedulerInterface.schedule`.

    Attributes:
        scheduled_new_reqs: Requests sent in full (first time, or resumed).
        scheduled_cached_reqs: Deltas for requests the workers already hold.
        num_scheduled_tokens: Tokens to compute this step, per request id.
        total_num_scheduled_tokens: Sum of ``num_scheduled_tokens``.
        finished_req_ids: Requests that ended since the previous step; workers drop them.
        preempted_req_ids: Requests preempted this step; workers drop them (they come back
            later as new requests carrying their output so far).
        kv_connector_metadata: Serialised connector metadata for the workers, if any.
        grammar_bitmask: The allowed tokens of the step's structured-output requests. A
            scheduler leaves it ``None``: EngineCore fills it after ``schedule()``.

    .. versionadded:: 1.0
    .. versionchanged:: 1.1 Added ``grammar_bitmask``.
    """

    scheduled_new_reqs: tuple[NewRequestData, ...]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: Mapping[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: frozenset[str] = frozenset()
    preempted_req_ids: frozenset[str] = frozenset()
    kv_connector_metadata: bytes | None = None
    grammar_bitmask: GrammarBitmask | None = None

    @property
    def is_empty(self) -> bool:
        """True when nothing is scheduled (the step only carries finished/preempted ids)."""
        return self.total_num_scheduled_tokens == 0


@dataclass(frozen=True)
class SampleLogprobs:
    """Log-probabilities of one sampled step for a set of rows.

    Row ``i`` belongs to the i-th request of the enclosing output. Column 0 is the sampled
    token, columns 1.. the top-``k`` tokens in descending order.

    Attributes:
        token_ids: ``[rows][1 + k]`` token ids.
        logprobs: ``[rows][1 + k]`` log-probabilities (of the processed distribution).
        sampled_token_ranks: ``[rows]`` 1-based rank of the sampled token.

    .. versionadded:: 1.0
    """

    token_ids: tuple[tuple[int, ...], ...]
    logprobs: tuple[tuple[float, ...], ...]
    sampled_token_ranks: tuple[int, ...]


@dataclass(frozen=True)
class ModelRunnerOutput:
    """What the workers return for one :class:`SchedulerOutput`.

    Attributes:
        req_ids: Requests of the step, in the order of the rows below.
        sampled_token_ids: Tokens sampled per request (empty while a prompt is still being
            prefilled in chunks).
        logprobs: Per-request sample logprobs (rows aligned with ``req_ids``) when any request
            asked for them; rows of requests that did not ask are empty tuples.
        prompt_logprobs: Prompt logprobs of the chunk computed this step, per request id, for
            requests that asked for them (rows aligned with prompt positions).
        finished_sending: KV-connector transfers that completed (request ids).
        finished_recving: KV-connector loads that completed (request ids).
        failed: Requests a plugin failed while serving them this step, with why (added in
            1.1). Their rows in ``sampled_token_ids`` are empty. EngineCore ends them with
            ``FINISHED_ERROR`` (``Scheduler.finish_requests``) right after
            ``update_from_output``, so a scheduler need not act on this field.

    .. versionadded:: 1.0
    .. versionchanged:: 1.1 Added ``failed``.
    """

    req_ids: tuple[str, ...]
    sampled_token_ids: tuple[tuple[int, ...], ...]
    logprobs: SampleLogprobs | None = None
    prompt_logprobs: Mapping[str, SampleLogprobs] = field(default_factory=dict)
    finished_sending: frozenset[str] = frozenset()
    finished_recving: frozenset[str] = frozenset()
    failed: Mapping[str, PluginFailure] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineCoreOutput:
    """New results of one request after one step: what EngineCore streams to the front end.

    Attributes:
        request_id: The request.
        new_token_ids: Tokens appended this step.
        new_logprobs: Their logprobs (rows aligned with ``new_token_ids``), if requested.
        new_prompt_logprobs: Prompt logprobs computed this step, if requested.
        finish_reason: ``"stop"``, ``"length"``, ``"abort"`` or ``"error"`` on the last
            output, else None.
        stop_reason: The stop token id that ended the request, if any.
        num_cached_tokens: Prompt tokens served from the prefix cache.
        error: With ``finish_reason == "error"``: the plugin that failed and why (added in
            1.1).

    .. versionadded:: 1.0
    .. versionchanged:: 1.1 Added ``error``.
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    new_logprobs: SampleLogprobs | None = None
    new_prompt_logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    error: PluginFailure | None = None

    @property
    def finished(self) -> bool:
        """True on the request's last output."""
        return self.finish_reason is not None


@dataclass(frozen=True, kw_only=True)
class SchedulerContext(PluginContext):
    """What a scheduler is told; built after the KV cache is sized.

    Attributes:
        block_size: Tokens per KV block.
        num_kv_blocks: Blocks the scheduler may hand out, with ids ``1 .. num_kv_blocks``:
            block 0 is the workers' null block (padding reads and writes land there) and is
            never given to a request.
        max_num_seqs: Most requests in one step.
        max_num_batched_tokens: Most tokens in one step.
        max_model_len: Longest sequence (prompt + output).
        enable_prefix_caching: Whether full blocks may be shared by hash.
        enable_chunked_prefill: Whether a prompt may be split across steps.
        policy: The selected scheduling policy.
        kv_connector: The scheduler side of the selected KV connector, if any.

    .. versionadded:: 1.0
    """

    block_size: int
    num_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    policy: SchedulingPolicy | None = None
    kv_connector: KVConnectorScheduler | None = None


class SchedulerInterface(Plugin, ABC):
    """A whole scheduler: decides what runs in each forward pass and owns the KV blocks.

    Called: every method on the EngineCore thread. ``schedule()`` exactly once per forward
    pass, then ``update_from_output()`` once with that pass's result; ``add_request`` and
    ``finish_requests`` only between those pairs. Nothing is called concurrently.

    Must: never leak KV blocks: once every request has finished, all blocks are free.

    .. versionadded:: 1.0
    """

    def __init__(self, ctx: SchedulerContext) -> None:
        self.ctx = ctx

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Choose the requests and token counts of the next forward pass.

        Called: once per engine step, before the model runs.
        Must: respect ``max_num_seqs`` and ``max_num_batched_tokens``; report requests that
        finished or were preempted since the previous call.
        """

    @abstractmethod
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply a step's sampled tokens: append them, check stop conditions, free blocks.

        Called: once after each ``schedule()``, with that call's output.
        Returns: one output per request that produced tokens or finished this step.
        """

    @abstractmethod
    def add_request(self, request: EngineRequest) -> None:
        """Queue a new request (waiting state).

        Raises:
            ValueError: a request with the same id is already known.
        """

    @abstractmethod
    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests from outside (abort, stop string found by the front end).

        Unknown or already finished ids are ignored. Their blocks are freed now and the
        workers are told in the next ``schedule()`` output.
        """

    @abstractmethod
    def get_num_unfinished_requests(self) -> int:
        """Waiting plus running requests."""

    def has_unfinished_requests(self) -> bool:
        """True when some request is waiting or running."""
        return self.get_num_unfinished_requests() > 0

    @abstractmethod
    def has_finished_requests(self) -> bool:
        """True when finished ids are pending delivery to the workers in the next step."""

    @abstractmethod
    def reset_prefix_cache(self) -> bool:
        """Drop every cached block not in use. Returns False if some blocks are in use."""

    @abstractmethod
    def make_stats(self) -> SchedulerStats:
        """A snapshot of the scheduler's state for stat loggers and metrics."""

    def shutdown(self) -> None:
        """Release resources; called once when the engine stops."""
