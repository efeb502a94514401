"""The scheduler EngineCore runs: the selected ``engine.schedulers`` class with its policy."""

from __future__ import annotations

from engine.core.plugin_construction import construct_plugin
from engine.core.startup import EngineSetup
from engine.sdk.groups import SCHEDULERS, SCHEDULING_POLICIES
from engine.sdk.kv_connector import KVConnectorScheduler
from engine.sdk.scheduler import SchedulerContext, SchedulerInterface
from engine.sdk.scheduling_policy import SchedulingPolicy, SchedulingPolicyContext


def make_scheduler(setup: EngineSetup, num_blocks: int, *,
                   kv_connector: KVConnectorScheduler | None = None) -> SchedulerInterface:
    """The selected scheduler with the selected policy, for a pool of ``num_blocks``.

    ``kv_connector``: the scheduler side of the selected KV connector, passed on in
    ``SchedulerContext.kv_connector`` (a scheduler that cannot use one must refuse it).
    """
    config = setup.config
    policy_name, scheduler_name = config.scheduling_policy, config.scheduler
    policy_cls: type[SchedulingPolicy] = setup.catalog.load(SCHEDULING_POLICIES, policy_name)
    scheduler_cls: type[SchedulerInterface] = setup.catalog.load(SCHEDULERS, scheduler_name)
    policy = construct_plugin(setup, SCHEDULING_POLICIES, policy_name, policy_cls,
                              lambda options: policy_cls(SchedulingPolicyContext(
        plugin_name=policy_name, options=options, process="engine_core",
        model=setup.source.display_name, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=setup.max_num_batched_tokens, num_kv_blocks=num_blocks,
    )))
    return construct_plugin(setup, SCHEDULERS, scheduler_name, scheduler_cls,
                            lambda options: scheduler_cls(SchedulerContext(
        plugin_name=scheduler_name, options=options, process="engine_core",
        model=setup.source.display_name, block_size=setup.block_size,
        num_kv_blocks=num_blocks, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=setup.max_num_batched_tokens,
        max_model_len=setup.max_model_len,
        enable_prefix_caching=config.enable_prefix_caching,
        enable_chunked_prefill=config.enable_chunked_prefill, policy=policy,
        kv_connector=kv_connector,
    )))
