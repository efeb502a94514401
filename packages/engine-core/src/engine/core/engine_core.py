"""``EngineCore``: the busy loop's body: schedule -> execute -> update_from_output.

EngineCore owns the scheduler (with its policy and the KV-cache manager) and the executor
(here: the worker in the same process). It exchanges only SDK data contracts with both, so
the worker can move to another process without changing this file.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from engine.core.client.core_client import EngineInfo
from engine.core.plugin_construction import construct_plugin
from engine.core.startup import EngineSetup
from engine.core.worker.worker import Worker
from engine.sdk.groups import SCHEDULERS, SCHEDULING_POLICIES
from engine.sdk.scheduler import (
    EngineCoreOutput,
    EngineRequest,
    RequestStatus,
    SchedulerContext,
    SchedulerInterface,
)
from engine.sdk.scheduling_policy import SchedulingPolicy, SchedulingPolicyContext
from engine.sdk.stats import SchedulerStats

logger = logging.getLogger("engine.core")


def make_scheduler(setup: EngineSetup, num_blocks: int) -> SchedulerInterface:
    """The selected scheduler with the selected policy, for a pool of ``num_blocks``."""
    config = setup.config
    policy_name, scheduler_name = config.scheduling_policy, config.scheduler
    policy_cls: type[SchedulingPolicy] = setup.catalog.load(SCHEDULING_POLICIES, policy_name)
    scheduler_cls: type[SchedulerInterface] = setup.catalog.load(SCHEDULERS, scheduler_name)
    policy = construct_plugin(setup, SCHEDULING_POLICIES, policy_name, policy_cls,
                              lambda options: policy_cls(SchedulingPolicyContext(
        plugin_name=policy_name, options=options, process="engine_core",
        model=setup.source.display_name, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens, num_kv_blocks=num_blocks,
    )))
    return construct_plugin(setup, SCHEDULERS, scheduler_name, scheduler_cls,
                            lambda options: scheduler_cls(SchedulerContext(
        plugin_name=scheduler_name, options=options, process="engine_core",
        model=setup.source.display_name, block_size=setup.block_size,
        num_kv_blocks=num_blocks, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=setup.max_model_len,
        enable_prefix_caching=config.enable_prefix_caching,
        enable_chunked_prefill=config.enable_chunked_prefill, policy=policy,
    )))


class EngineCore:
    """Scheduler + executor; one ``step()`` is one forward pass."""

    def __init__(self, setup: EngineSetup, *, eos_token_id: int | None) -> None:
        self.setup = setup
        self.worker = Worker(setup, eos_token_id=eos_token_id)
        # The worker's cache has one more block than the scheduler hands out: block 0 is
        # the null block.
        self.num_blocks = self.worker.num_blocks - 1
        self.scheduler = make_scheduler(setup, self.num_blocks)

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request (validated and tokenized by the front end)."""
        self.scheduler.add_request(request)

    def add_requests(self, requests: Iterable[EngineRequest]) -> None:
        """Queue several requests."""
        for request in requests:
            self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """End requests now; their blocks are freed."""
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests with ``status`` (e.g. a stop string found by the front end)."""
        self.scheduler.finish_requests(list(request_ids), status)

    def has_unfinished_requests(self) -> bool:
        """True while some request waits or runs."""
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, execute and update once; returns the step's per-request outputs."""
        if not self.scheduler.has_unfinished_requests() and not (
                self.scheduler.has_finished_requests()):
            return []
        scheduler_output = self.scheduler.schedule()
        runner_output = self.worker.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def info(self) -> EngineInfo:
        """What a front end learns once this EngineCore is up."""
        setup = self.setup
        return EngineInfo(model_name=setup.source.display_name,
                          max_model_len=setup.max_model_len, num_kv_blocks=self.num_blocks,
                          block_size=setup.block_size, vocab_size=setup.vocab_size)

    def make_stats(self) -> SchedulerStats:
        """The scheduler's current stats."""
        return self.scheduler.make_stats()

    def reset_prefix_cache(self) -> bool:
        """Drop cached blocks not in use."""
        return self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the scheduler."""
        self.scheduler.shutdown()
