"""Driving a ``SchedulerInterface`` against a fake worker, through SDK contracts only.

The fake worker keeps per-request state exactly as a real one must (new requests in full,
cached ones as deltas, finished and preempted ids dropped) and a fake KV cache: every
scheduled token writes ``(position, token)`` into its slot, and the fake model samples the
next token from the context it reads back through the block table, after checking that
every slot holds what the request expects. A wrong block table, a wrong prefix-cache hit
or a stale cached block therefore changes tokens or fails loudly, and any run can be
compared with :func:`reference_tokens`, computed without a scheduler.

.. versionadded:: 1.0
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from engine.sdk.sampling_params import SamplingParams
from engine.sdk.scheduler import (
    EngineCoreOutput,
    EngineRequest,
    ModelRunnerOutput,
    NewRequestData,
    RequestStatus,
    SchedulerInterface,
    SchedulerOutput,
)

__all__ = ["FAKE_VOCAB_SIZE", "FakeWorker", "SchedulerDriver", "fake_next_token",
           "reference_tokens"]

#: Token ids the fake model produces are below this.
FAKE_VOCAB_SIZE = 1000


def fake_next_token(context: Sequence[int]) -> int:
    """The fake model: a deterministic function of the whole context (tokens and order)."""
    acc = 0
    for position, token in enumerate(context):
        acc = (acc * 31 + token * (position + 1)) % 1_000_003
    return acc % FAKE_VOCAB_SIZE


def reference_tokens(prompt: Sequence[int], max_tokens: int) -> list[int]:
    """What any correct scheduler must produce for ``prompt``: no batching, no cache."""
    context = list(prompt)
    for _ in range(max_tokens):
        context.append(fake_next_token(context))
    return context[len(prompt):]


@dataclass
class _WorkerRequest:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    params: SamplingParams


class WorkerRequestView(Protocol):
    """What a fake worker keeps per request (its own copy of the sequence and blocks)."""

    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


S = TypeVar("S", bound=WorkerRequestView)


def apply_deltas(requests: dict[str, S], out: SchedulerOutput,
                 new_state: Callable[[NewRequestData], S]) -> None:
    """Bring a fake worker's ``requests`` up to date with ``out``, as a worker does.

    Finished and preempted requests leave first, then new ones arrive (``new_state``
    builds each), then cached ones get their new blocks.

    Raises:
        AssertionError: a rule of the deltas is broken (named in the message).
    """
    for req_id in out.finished_req_ids | out.preempted_req_ids:
        requests.pop(req_id, None)
    for new in out.scheduled_new_reqs:
        assert new.req_id not in requests, (
            f"{new.req_id} sent as a new request while the worker still has it")
        requests[new.req_id] = new_state(new)
    cached = out.scheduled_cached_reqs
    for req_id, new_block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True):
        assert req_id in requests, f"a cached-request delta for unknown {req_id}"
        state = requests[req_id]
        assert state.num_computed_tokens == num_computed, (
            f"{req_id}: num_computed_tokens {num_computed}, the worker has "
            f"{state.num_computed_tokens}")
        state.block_ids.extend(new_block_ids)


def sample_step(requests: dict[str, S], out: SchedulerOutput,
                context_of: Callable[[S], Sequence[int]],
                ) -> tuple[tuple[str, ...], tuple[tuple[int, ...], ...], int]:
    """Advance each scheduled request and sample the fake model for the complete ones.

    Returns:
        ``(req_ids, sampled_token_ids, num_partial)``: the runner output's rows, and how
        many requests computed only part of their known tokens (nothing sampled).
    """
    req_ids: list[str] = []
    sampled: list[tuple[int, ...]] = []
    num_partial = 0
    for req_id, num_tokens in out.num_scheduled_tokens.items():
        state = requests[req_id]
        state.num_computed_tokens += num_tokens
        req_ids.append(req_id)
        if state.num_computed_tokens < len(state.token_ids):
            num_partial += 1
            sampled.append(())
            continue
        token = fake_next_token(context_of(state))
        state.token_ids.append(token)  # the worker keeps its own copy of the sequence
        sampled.append((token,))
    return tuple(req_ids), tuple(sampled), num_partial


class FakeWorker:
    """Applies each ``SchedulerOutput`` as a worker does and samples from a fake KV cache.

    Args:
        block_size: Tokens per KV block.
        num_kv_blocks: Usable block ids ``1..num_kv_blocks`` (block 0 is the null block).

    Attributes:
        requests: The worker's view of each scheduled request.
        num_partial_chunks: Steps in which a request's prompt was only partly computed.
    """

    def __init__(self, block_size: int, num_kv_blocks: int) -> None:
        self.block_size = block_size
        self.kv: list[tuple[int, int] | None] = [None] * (block_size * (num_kv_blocks + 1))
        self.requests: dict[str, _WorkerRequest] = {}
        self.num_partial_chunks = 0

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; fails with an ``AssertionError`` naming the broken rule."""
        apply_deltas(self.requests, out, lambda new: _WorkerRequest(
            [*new.prompt_token_ids, *new.output_token_ids], list(new.block_ids),
            new.num_computed_tokens, new.sampling_params))
        cached = out.scheduled_cached_reqs
        scheduled = [new.req_id for new in out.scheduled_new_reqs] + list(cached.req_ids)
        assert sorted(scheduled) == sorted(out.num_scheduled_tokens), (
            "num_scheduled_tokens must name exactly the new and cached requests")
        self._write_kv(out)
        return self._sample(out)

    def slot(self, state: _WorkerRequest, position: int) -> int:
        """The KV slot of ``position`` through the request's block table."""
        block_id = state.block_ids[position // self.block_size]
        assert block_id != 0, "block 0 is the null block: never in a block table"
        return block_id * self.block_size + position % self.block_size

    def _write_kv(self, out: SchedulerOutput) -> None:
        written: set[int] = set()
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            state = self.requests[req_id]
            end = state.num_computed_tokens + num_tokens
            assert num_tokens > 0, f"{req_id} scheduled for {num_tokens} tokens"
            assert end <= len(state.token_ids), f"{req_id} scheduled past its known tokens"
            assert len(state.block_ids) == -(-end // self.block_size), (
                f"{req_id}: {len(state.block_ids)} blocks for {end} tokens")
            for position in range(state.num_computed_tokens, end):
                slot = self.slot(state, position)
                assert slot not in written, f"KV slot {slot} written twice in one step"
                written.add(slot)
                self.kv[slot] = (position, state.token_ids[position])

    def _sample(self, out: SchedulerOutput) -> ModelRunnerOutput:
        # The fake model reads its context from the KV cache, not from the token ids.
        req_ids, sampled, num_partial = sample_step(self.requests, out, lambda state: [
            self.read(state, pos) for pos in range(len(state.token_ids))])
        self.num_partial_chunks += num_partial
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)

    def read(self, state: _WorkerRequest, position: int) -> int:
        """The token whose KV the slot of ``position`` holds (checked against the request)."""
        entry = self.kv[self.slot(state, position)]
        expected = (position, state.token_ids[position])
        assert entry == expected, (
            f"KV slot for position {position} holds {entry}, expected {expected}: a wrong "
            f"block table, prefix-cache hit or reused block")
        return expected[1]


@dataclass
class SchedulerDriver:
    """Drives scheduler + :class:`FakeWorker`, checking the SDK's rules after every step.

    Subclass and extend :meth:`check_step` / :meth:`after_step` for checks of your own
    scheduler's internals.

    Attributes:
        scheduler: The scheduler under test.
        outputs: Tokens generated so far, per request id.
        finish_reasons: ``"stop"``, ``"length"`` or ``"abort"`` per finished request id.
        core_outputs: Every ``EngineCoreOutput`` per request id.
        steps: Every ``SchedulerOutput``, in order.
        live_ids: Requests added and not finished.
        num_preempted: Preemptions seen in ``SchedulerOutput.preempted_req_ids``.
        max_num_scheduled_reqs: The most requests one step scheduled.
    """

    scheduler: SchedulerInterface
    worker: FakeWorker = field(init=False)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    finish_reasons: dict[str, str] = field(default_factory=dict)
    core_outputs: dict[str, list[EngineCoreOutput]] = field(default_factory=dict)
    steps: list[SchedulerOutput] = field(default_factory=list)
    live_ids: set[str] = field(default_factory=set)
    num_preempted: int = 0
    max_num_scheduled_reqs: int = 0

    def __post_init__(self) -> None:
        ctx = self.scheduler.ctx
        self.worker = FakeWorker(ctx.block_size, ctx.num_kv_blocks)

    def add(self, request_id: str, prompt: Sequence[int], **params: Any) -> None:
        """Queue a request (``max_tokens`` defaults to 8).

        ``params`` are ``SamplingParams`` fields, plus ``priority`` and ``eos_token_id``.
        """
        params.setdefault("max_tokens", 8)
        priority = params.pop("priority", 0)
        eos_token_id = params.pop("eos_token_id", None)
        self.scheduler.add_request(EngineRequest(
            request_id=request_id, prompt_token_ids=tuple(prompt),
            sampling_params=SamplingParams(**params), eos_token_id=eos_token_id,
            arrival_time=float(len(self.outputs)), priority=priority))
        self.outputs[request_id] = []
        self.live_ids.add(request_id)

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests (unknown and finished ids are ignored by the scheduler)."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        for request_id in request_ids:
            if request_id in self.live_ids:
                self.finish_reasons[request_id] = "abort"
            self.live_ids.discard(request_id)

    def step(self) -> SchedulerOutput:
        """``schedule()``, the fake worker, ``update_from_output()``, then the checks."""
        out = self.scheduler.schedule()
        self.steps.append(out)
        self.check_step(out)
        runner_output = self.worker.execute(out)
        for core in self.scheduler.update_from_output(out, runner_output):
            assert core.request_id in self.outputs, f"output for unknown {core.request_id}"
            assert core.request_id not in self.finish_reasons, (
                f"output for {core.request_id} after it finished")
            self.outputs[core.request_id].extend(core.new_token_ids)
            self.core_outputs.setdefault(core.request_id, []).append(core)
            if core.finish_reason is not None:
                self.finish_reasons[core.request_id] = core.finish_reason
                self.live_ids.discard(core.request_id)
        self.after_step(out)
        return out

    def run(self, max_steps: int = 10_000,
            on_step: Callable[[int], None] | None = None) -> None:
        """Step until nothing is unfinished, then check that every KV block is free."""
        for index in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                break
            if on_step is not None:
                on_step(index)
            self.step()
        else:
            raise AssertionError(f"requests still unfinished after {max_steps} steps: "
                                 f"{sorted(self.live_ids)[:8]} (no progress?)")
        self.step()  # deliver the last finished ids to the worker
        self.assert_pool_full()
        assert self.worker.requests == {}, (
            f"the worker still holds {sorted(self.worker.requests)}: finished or aborted "
            f"ids never reached it through finished_req_ids")

    def assert_pool_full(self) -> None:
        """Nothing unfinished and every KV block free (through ``make_stats``)."""
        assert not self.scheduler.has_unfinished_requests()
        assert self.scheduler.get_num_unfinished_requests() == 0
        stats = self.scheduler.make_stats()
        assert stats.num_total_blocks == self.scheduler.ctx.num_kv_blocks, (
            f"make_stats() reports {stats.num_total_blocks} blocks, the context has "
            f"{self.scheduler.ctx.num_kv_blocks}")
        assert stats.num_free_blocks == stats.num_total_blocks, (
            f"{stats.num_total_blocks - stats.num_free_blocks} KV blocks leaked")
        assert stats.num_running_reqs == stats.num_waiting_reqs == 0
        assert stats.kv_cache_usage == 0.0

    def check_step(self, out: SchedulerOutput) -> None:
        """The SDK's rules for one ``SchedulerOutput`` (before the worker runs it)."""
        ctx = self.scheduler.ctx
        counts = out.num_scheduled_tokens
        assert out.total_num_scheduled_tokens == sum(counts.values()), (
            "total_num_scheduled_tokens is not the sum of num_scheduled_tokens")
        assert out.total_num_scheduled_tokens <= ctx.max_num_batched_tokens, (
            f"{out.total_num_scheduled_tokens} tokens scheduled, the budget is "
            f"{ctx.max_num_batched_tokens}")
        assert len(counts) <= ctx.max_num_seqs, (
            f"{len(counts)} requests scheduled, max_num_seqs is {ctx.max_num_seqs}")
        self.max_num_scheduled_reqs = max(self.max_num_scheduled_reqs, len(counts))
        self.num_preempted += len(out.preempted_req_ids)
        new_ids = {new.req_id for new in out.scheduled_new_reqs}
        assert not new_ids & set(out.scheduled_cached_reqs.req_ids), (
            "a request is both new and cached in one step")
        assert not out.preempted_req_ids & set(counts), "a preempted request is scheduled"
        for new in out.scheduled_new_reqs:  # a resumed request carries its output so far
            assert list(new.output_token_ids) == self.outputs[new.req_id], (
                f"{new.req_id} resumed without the tokens it had generated")

    def after_step(self, out: SchedulerOutput) -> None:
        """Hook after each step's outputs were recorded (nothing by default)."""
