"""``Scheduler``: the default scheduler, registered as ``default`` in ``engine.schedulers``.

Iteration-level scheduling under a token budget, without prefill/decode phases: every
request's ``num_computed_tokens`` catches up with its ``num_tokens`` (a decoding request
is one token behind; a prompt may take several steps). One ``schedule()``:

1. Running requests, in running (admission) order, while the budget lasts: each gets
   ``min(num_tokens - num_computed_tokens, budget)`` tokens. When its blocks cannot be
   allocated, ``policy.select_preemption_victim`` picks a running request to preempt by
   recompute: its blocks are freed, ``num_computed_tokens`` goes back to 0 and it waits
   again (PREEMPTED). A victim already scheduled in this step is unscheduled (its tokens
   return to the budget; hashes of blocks this step would have filled are dropped, since
   that KV will never be written). Repeat until the allocation succeeds or the request
   is itself the victim.
2. Waiting requests, in the policy's order, unless step 1 preempted something (memory is
   short: admitting now would only thrash), while the budget and ``max_num_seqs`` allow:
   prefix-cache lookup, chunk sizing (cut to the budget with chunked prefill; without it a
   request waits until the budget holds its whole remainder), block check,
   ``policy.can_admit``, allocation. The first request that cannot start ends admission
   for the step, so the policy's order is kept (head-of-line).
3. Output: new requests (first time, or resumed) in full with their whole block table;
   the others as deltas with only their new block ids. Then each scheduled request's
   ``num_computed_tokens`` advances by its scheduled tokens.

``update_from_output`` appends the token sampled for each request that computed all its
tokens (a partial prefill chunk samples nothing), applies the stop conditions (see
``engine.core.scheduler.request``), frees finished requests' blocks and reports them to
the workers in the next step's ``finished_req_ids``.

With a KV connector (``ctx.kv_connector``), admission in step 2 also asks the connector how
many tokens past the local prefix-cache hits it can supply: they count as computed (the
workers load them before the forward pass), or, when the connector loads them
asynchronously, the request takes its blocks and waits outside the queue until a worker
reports the load (``ModelRunnerOutput.finished_recving``). Each ``schedule()`` ends with
the connector's metadata for the step; a finished request's blocks may be held until a
worker reports its save (``finished_sending``). See ``engine.core.scheduler._connector``.

A connector call that raises fails the requests it concerned, not the engine: a lookup or
``update_state_after_alloc`` that one request; ``build_connector_meta`` every request of
the step (the step then runs nothing). They end with ``FINISHED_ERROR``, their blocks
freed and left out of the prefix cache, reported by the next ``update_from_output`` with
an ``error`` naming the connector. (``finish_requests(ids, FINISHED_ERROR)``, which
EngineCore calls for requests a worker-side plugin failed, frees the same way.)
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import replace

from engine.core.kv_cache import KVCacheBlock, KVCacheManager
from engine.core.scheduler._connector import KVConnectorBridge
from engine.core.scheduler._step import Lookup, Step, build_output, request_output
from engine.core.scheduler._validation import validate_context, validate_request
from engine.core.scheduler.policies import FCFSPolicy
from engine.core.scheduler.request import Request
from engine.core.scheduler.waiting_queue import WaitingQueue
from engine.sdk.errors import PluginError, PluginFailure
from engine.sdk.scheduler import (
    EngineCoreOutput,
    EngineRequest,
    ModelRunnerOutput,
    RequestStatus,
    SchedulerContext,
    SchedulerInterface,
    SchedulerOutput,
)
from engine.sdk.scheduling_policy import SchedulerState, SchedulingPolicy, SchedulingPolicyContext
from engine.sdk.stats import SchedulerStats

logger = logging.getLogger("engine.scheduler")


class Scheduler(SchedulerInterface):
    """The default scheduler: token budget, chunked prefill, prefix caching, recompute.

    Args:
        ctx: Sizes and switches; ``ctx.policy`` orders, admits and picks victims
            (``FCFSPolicy`` when None).

    Raises:
        ValueError: The context is inconsistent (e.g. the KV cache cannot hold one
            ``max_model_len`` sequence).
    """

    def __init__(self, ctx: SchedulerContext) -> None:
        super().__init__(ctx)
        validate_context(ctx)
        self.policy: SchedulingPolicy
        if ctx.policy is not None:
            self.policy = ctx.policy
        else:
            self.policy = FCFSPolicy(
                SchedulingPolicyContext(
                    plugin_name=FCFSPolicy.name,
                    process="engine_core",
                    max_num_seqs=ctx.max_num_seqs,
                    max_num_batched_tokens=ctx.max_num_batched_tokens,
                    num_kv_blocks=ctx.num_kv_blocks,
                )
            )
        self.kv_cache_manager = KVCacheManager(
            ctx.block_size, ctx.num_kv_blocks, ctx.enable_prefix_caching
        )
        self._requests: dict[str, Request] = {}  # unfinished requests
        self._running: list[Request] = []
        self._waiting = WaitingQueue(self.policy)
        self._finished_req_ids: set[str] = set()
        # Requests a connector call failed, reported by the next update_from_output.
        self._failed: dict[str, PluginFailure] = {}
        self._connector = (KVConnectorBridge(ctx.kv_connector)
                           if ctx.kv_connector is not None else None)
        # Waiting requests holding blocks an asynchronous connector load filled.
        self._parked: dict[str, Request] = {}
        self._num_added = 0
        self._num_preemptions = 0  # since the last make_stats()

    # -- state queries ---------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """KV blocks no request holds (evictable cached blocks included)."""
        return self.kv_cache_manager.num_free_blocks

    @property
    def num_running_reqs(self) -> int:
        """Requests running (admitted, holding blocks)."""
        return len(self._running)

    @property
    def num_waiting_reqs(self) -> int:
        """Requests waiting (new, preempted, or loading through the KV connector)."""
        return len(self._waiting) + self._num_loading

    @property
    def _num_loading(self) -> int:
        return len(self._connector.loading) if self._connector is not None else 0

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None."""
        return self._requests.get(request_id)

    def get_num_unfinished_requests(self) -> int:
        """Waiting plus running requests."""
        return len(self._requests)

    def has_finished_requests(self) -> bool:
        """True when finished ids are pending delivery to the workers.

        Also while finished requests hold blocks for the KV connector: steps must go on
        (empty ones) until the workers report those transfers.
        """
        return bool(self._finished_req_ids) or (
            self._connector is not None and self._connector.num_held > 0)

    # -- requests in and out ---------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        """Queue a new request.

        Raises:
            ValueError: The id is already known, the prompt is empty, or it is longer
                than ``max_model_len``.
        """
        request_id = request.request_id
        validate_request(request, self.ctx.max_model_len, request_id in self._requests or (
            self._connector is not None and self._connector.is_held(request_id)))
        self._num_added += 1
        internal = Request(request, self.ctx.max_model_len, seq=self._num_added)
        self._requests[internal.request_id] = internal
        self._waiting.push(internal)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests from outside (abort, stop string); frees their blocks now.

        Unknown or already finished ids are ignored.

        Raises:
            ValueError: ``status`` is not a ``FINISHED_*`` state.
        """
        if not status.is_finished:
            raise ValueError(f"finish_requests needs a FINISHED_* status, got {status.name}")
        num_running_finished = 0
        for request_id in request_ids:
            request = self._requests.pop(request_id, None)
            if request is None:
                continue
            if request.status is RequestStatus.RUNNING:
                num_running_finished += 1
            elif self._connector is None or request_id not in self._connector.loading:
                self._waiting.remove(request)  # (a loading request is not in the queue)
            request.status = status
            self._free_request(request)
        if num_running_finished:
            self._running = [r for r in self._running if not r.status.is_finished]

    # -- one step --------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose the requests and token counts of the next forward pass (module header)."""
        step = Step(token_budget=self.ctx.max_num_batched_tokens)
        self._schedule_running(step)
        if not step.preempted_req_ids:
            self._schedule_waiting(step)
        output = self._build_output(step)
        if self._connector is not None:
            try:
                output = replace(output,
                                 kv_connector_metadata=self._connector.build_meta(output))
            except PluginError as exc:
                output = self._fail_step(step, output, exc)
        requests = self._requests
        for request_id, num_tokens in step.num_scheduled_tokens.items():
            requests[request_id].num_computed_tokens += num_tokens
        return output

    def _schedule_running(self, step: Step) -> None:
        for request in tuple(self._running):
            if step.token_budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            num_new_tokens = min(
                request.num_tokens - request.num_computed_tokens, step.token_budget
            )
            if num_new_tokens <= 0:
                continue
            new_blocks = self._allocate_or_preempt(request, num_new_tokens, step)
            if new_blocks is None:
                continue
            step.num_scheduled_tokens[request.request_id] = num_new_tokens
            step.token_budget -= num_new_tokens
            new_block_ids = tuple([block.block_id for block in new_blocks]) if new_blocks else ()
            step.cached_reqs[request.request_id] = (request, new_block_ids)

    def _allocate_or_preempt(
        self, request: Request, num_new_tokens: int, step: Step
    ) -> list[KVCacheBlock] | None:
        """Allocate for a running request, preempting victims until it fits (or is one)."""
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
            if new_blocks is not None:
                return new_blocks
            victim = self._select_victim()
            self._preempt(victim, step)
            if victim is request:
                return None

    def _select_victim(self) -> Request:
        chosen = self.policy.select_preemption_victim(tuple(self._running))
        victim = self._requests.get(chosen.request_id)
        if victim is None or victim is not chosen or victim.status is not RequestStatus.RUNNING:
            raise RuntimeError(
                f"scheduling policy {type(self.policy).__qualname__} chose "
                f"{chosen.request_id!r} as preemption victim, which is not a running request; "
                "select_preemption_victim must return an element of `running`"
            )
        return victim

    def _preempt(self, victim: Request, step: Step) -> None:
        self._running.remove(victim)
        request_id = victim.request_id
        num_unscheduled = step.num_scheduled_tokens.pop(request_id, 0)
        step.token_budget += num_unscheduled
        step.cached_reqs.pop(request_id, None)
        self.kv_cache_manager.free(victim, num_valid_tokens=victim.num_computed_tokens)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self._waiting.push(victim)
        step.preempted_req_ids.add(request_id)
        self._num_preemptions += 1

    def _schedule_waiting(self, step: Step) -> None:
        kv = self.kv_cache_manager
        max_num_seqs = self.ctx.max_num_seqs
        while self._waiting and step.token_budget > 0 and len(self._running) < max_num_seqs:
            request = self._waiting.peek()
            try:
                found = self._lookup(request)
            except PluginError as exc:
                self._waiting.pop()
                self._fail(request, exc)
                continue
            if found.load_async:
                if not self._start_async_load(request, found, step):
                    break
                continue
            num_computed = found.num_local_tokens + found.num_external_tokens
            num_new_tokens = request.num_tokens - num_computed
            if num_new_tokens > step.token_budget:
                if not self.ctx.enable_chunked_prefill:
                    break
                num_new_tokens = step.token_budget
            # External tokens need blocks too; the workers load them before the forward.
            num_to_allocate = found.num_external_tokens + num_new_tokens
            if not kv.can_allocate(request, num_to_allocate, found.hit_blocks):
                if not self._unpark_for(request):
                    break
                continue
            if not self.policy.can_admit(request, self._state(step)):
                break
            if kv.allocate_slots(request, num_to_allocate, found.hit_blocks) is None:
                raise RuntimeError("KV-cache allocation failed after can_allocate agreed")
            self._waiting.pop()
            request.num_computed_tokens = found.num_local_tokens
            if found.asked_connector and self._connector is not None:
                try:
                    self._connector.after_alloc(request, kv.get_block_ids(request.request_id),
                                                found.num_external_tokens)
                except PluginError as exc:
                    self._fail(request, exc)
                    continue
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_computed
            self._parked.pop(request.request_id, None)
            self._running.append(request)
            step.new_reqs.append(request)
            step.num_scheduled_tokens[request.request_id] = num_new_tokens
            step.token_budget -= num_new_tokens

    def _lookup(self, request: Request) -> Lookup:
        """Tokens of a waiting request already available: local hits, then the connector's."""
        kv = self.kv_cache_manager
        if kv.get_blocks(request.request_id):  # its asynchronous load has completed
            return Lookup([], request.num_computed_tokens)
        # Prompt logprobs need every prompt position computed: no hits of either kind.
        if request.sampling_params.prompt_logprobs is not None:
            return Lookup([], 0)
        hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
        if self._connector is None:
            return Lookup(hit_blocks, num_hit_tokens)
        num_external, load_async = self._connector.match(request, num_hit_tokens)
        return Lookup(hit_blocks, num_hit_tokens, num_external, load_async, True)

    def _unpark_for(self, request: Request) -> bool:
        """Free the blocks of parked requests when nothing else could make room.

        A request whose asynchronous load completed waits holding its blocks; if the head
        of the queue cannot get blocks while nothing runs (so nothing will finish or be
        preempted), those blocks go back to the pool (their content stays in the prefix
        cache) and the parked requests look up their tokens again when admitted.

        Returns:
            True if blocks were freed (try the allocation again).
        """
        others = [r for r in self._parked.values() if r is not request]
        if self._running or not others:
            return False
        for parked in others:
            del self._parked[parked.request_id]
            self.kv_cache_manager.free(parked)
            parked.num_computed_tokens = 0
        return True

    def _start_async_load(self, request: Request, found: Lookup, step: Step) -> bool:
        """Give ``request`` blocks for its external tokens and park it until they arrive.

        Returns False (nothing changed) when the blocks or the policy say not now.
        """
        kv, connector = self.kv_cache_manager, self._connector
        assert connector is not None  # load_async comes from the connector
        num_external = found.num_external_tokens
        if not kv.can_allocate(request, num_external, found.hit_blocks):
            return False
        if not self.policy.can_admit(request, self._state(step)):
            return False
        if kv.allocate_slots(request, num_external, found.hit_blocks,
                             delay_caching=True) is None:
            raise RuntimeError("KV-cache allocation failed after can_allocate agreed")
        self._waiting.pop()
        request.num_computed_tokens = found.num_local_tokens
        try:
            connector.after_alloc(request, kv.get_block_ids(request.request_id), num_external)
        except PluginError as exc:
            self._fail(request, exc)
            return True
        connector.start_loading(request, found.num_local_tokens + num_external)
        return True

    def _state(self, step: Step) -> SchedulerState:
        return SchedulerState(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            num_free_blocks=self.kv_cache_manager.num_free_blocks,
            num_total_blocks=self.ctx.num_kv_blocks,
            num_scheduled_tokens=self.ctx.max_num_batched_tokens - step.token_budget,
            token_budget=step.token_budget,
        )

    def _build_output(self, step: Step) -> SchedulerOutput:
        finished_req_ids = frozenset(self._finished_req_ids)
        self._finished_req_ids.clear()
        return build_output(step, self.kv_cache_manager, finished_req_ids,
                            self.ctx.max_num_batched_tokens)

    # -- results ---------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop conditions, free finished requests' blocks.

        Returns:
            One output per request that produced tokens, finished, or got prompt logprobs.
        """
        row_of = {req_id: row for row, req_id in enumerate(runner_output.req_ids)}
        outputs: list[EngineCoreOutput] = []
        num_finished = 0
        for request_id in scheduler_output.num_scheduled_tokens:
            request = self._requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            row = row_of.get(request_id)
            output = request_output(request, row, runner_output)
            if output is None:
                continue
            outputs.append(output)
            if output.finish_reason is not None:
                num_finished += 1
                del self._requests[request_id]
                self._free_request(request)
        if num_finished:
            self._running = [r for r in self._running if r.status is RequestStatus.RUNNING]
        if self._connector is not None:
            self._apply_transfers(runner_output)
        if self._failed:
            outputs.extend(EngineCoreOutput(request_id, (), finish_reason="error", error=failure)
                           for request_id, failure in self._failed.items())
            self._failed.clear()
        return outputs

    def _fail(self, request: Request, error: PluginError) -> None:
        """End ``request`` now because a connector call failed it (module docstring)."""
        self._requests.pop(request.request_id, None)
        if request in self._running:
            self._running.remove(request)
        request.status = RequestStatus.FINISHED_ERROR
        self._free_request(request)
        self._failed[request.request_id] = PluginFailure.from_error(error)
        logger.error("%s; failing request %s", error, request.request_id)

    def _fail_step(self, step: Step, output: SchedulerOutput,
                   error: PluginError) -> SchedulerOutput:
        """``build_connector_meta`` failed: fail the step's requests, schedule nothing."""
        for request_id in list(step.num_scheduled_tokens):
            request = self._requests.get(request_id)
            if request is not None:
                self._fail(request, error)
        step.num_scheduled_tokens.clear()
        step.new_reqs.clear()
        step.cached_reqs.clear()
        self._finished_req_ids |= output.finished_req_ids
        empty = self._build_output(step)
        assert self._connector is not None
        try:  # the workers' connector side expects metadata on every step
            return replace(empty, kv_connector_metadata=self._connector.build_meta(empty))
        except PluginError:
            return empty

    def _free_request(self, request: Request) -> None:
        """Free a finished request's blocks (unless the connector holds them); report it."""
        request_id = request.request_id
        self._parked.pop(request_id, None)
        kv = self.kv_cache_manager
        if self._connector is None or not self._connector.finished(
                request, kv.get_block_ids(request_id)):
            # A failed request's KV may be incomplete: none of it stays in the prefix cache.
            kv.free(request, num_valid_tokens=(
                0 if request.status is RequestStatus.FINISHED_ERROR else None))
        self._finished_req_ids.add(request_id)

    def _apply_transfers(self, runner_output: ModelRunnerOutput) -> None:
        """Loads the workers completed make requests schedulable; held blocks are freed."""
        assert self._connector is not None
        results = self._connector.on_transfers(runner_output)
        kv = self.kv_cache_manager
        for request in results.loaded:
            # The KV is in the blocks now: others may find them in the prefix cache.
            kv.cache_blocks(request, request.num_computed_tokens)
            self._parked[request.request_id] = request
            self._waiting.push(request)
        for request in results.released:
            kv.free(request)

    # -- maintenance -----------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block not in use. Returns False if some blocks are in use."""
        return self.kv_cache_manager.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats:
        """Snapshot; prefix-cache lookups and preemptions count since the previous call."""
        num_preemptions, self._num_preemptions = self._num_preemptions, 0
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running_reqs=len(self._running),
            num_waiting_reqs=len(self._waiting),
            kv_cache_usage=kv.usage,
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=self.ctx.num_kv_blocks,
            prefix_cache=kv.make_prefix_cache_stats(),
            num_preempted_reqs=num_preemptions,
            connector_prefix_cache=(self._connector.make_prefix_cache_stats()
                                    if self._connector is not None else None),
        )

