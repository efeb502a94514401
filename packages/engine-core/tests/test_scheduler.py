"""The default scheduler driven against the contract suite's fake worker.

``engine.testing.contracts.SchedulerDriver`` (the harness plugin authors get) drives the
scheduler against a fake worker and KV cache whose model reads every token back through
the block tables; ``Sim`` below adds checks of the default scheduler's internals (block
reference counts, cached block contents). ``test_scheduler_contract.py`` runs the published
suite itself.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from engine.core.kv_cache import BlockHash
from engine.core.scheduler import PriorityPolicy, Scheduler
from engine.sdk import (
    RequestStatus,
    RequestView,
    SchedulerContext,
    SchedulerOutput,
    SchedulingPolicy,
    SchedulingPolicyContext,
)
from engine.testing.contracts import FAKE_VOCAB_SIZE, SchedulerDriver, reference_tokens

VOCAB_SIZE = FAKE_VOCAB_SIZE
BLOCK_SIZE = 4


def make_scheduler(policy: SchedulingPolicy | None = None, **overrides: Any) -> Scheduler:
    values: dict[str, Any] = dict(
        block_size=BLOCK_SIZE,
        num_kv_blocks=64,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        max_model_len=64,
    )
    values.update(overrides)
    return Scheduler(SchedulerContext(plugin_name="default", policy=policy, **values))


def policy_ctx() -> SchedulingPolicyContext:
    return SchedulingPolicyContext(plugin_name="test")


# -- the driver: the published contract harness + the default scheduler's internals ---


@dataclass
class Sim(SchedulerDriver):
    """``SchedulerDriver`` plus checks of the default scheduler's block pool and cache."""

    scheduler: Scheduler
    hash_contents: dict[BlockHash, tuple[int, tuple[int, ...]]] = field(default_factory=dict)

    def check_step(self, out: SchedulerOutput) -> None:
        super().check_step(out)
        assert self.scheduler.num_running_reqs <= self.scheduler.ctx.max_num_seqs
        self.record_hashes(out)

    def after_step(self, out: SchedulerOutput) -> None:
        self.check_blocks()
        self.check_cached_block_contents()

    def run(self, max_steps: int = 10_000, on_step: Callable[[int], None] | None = None) -> None:
        super().run(max_steps, on_step)
        assert_all_blocks_free(self.scheduler)

    def check_blocks(self) -> None:
        kv = self.scheduler.kv_cache_manager
        holders: dict[int, int] = {}
        for request_id in self.live_ids:
            block_ids = kv.get_block_ids(request_id)
            assert len(set(block_ids)) == len(block_ids)
            for block_id in block_ids:
                holders[block_id] = holders.get(block_id, 0) + 1
        for block in kv.block_pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0), block
            if block.ref_cnt > 1:
                assert block.block_hash is not None, f"{block} shared without a hash"
        assert kv.num_free_blocks == sum(1 for b in kv.block_pool.blocks if b.ref_cnt == 0)

    def record_hashes(self, out: SchedulerOutput) -> None:
        for request_id in out.num_scheduled_tokens:
            request = self.scheduler.get_request(request_id)
            assert request is not None
            for index, block_hash in enumerate(request.block_hashes):
                start = index * BLOCK_SIZE
                content = (index, tuple(request.all_token_ids[start : start + BLOCK_SIZE]))
                assert self.hash_contents.setdefault(block_hash, content) == content

    def check_cached_block_contents(self) -> None:
        """A cached block holds exactly the KV its hash names."""
        for block in self.scheduler.kv_cache_manager.block_pool.blocks:
            if block.block_hash is None:
                continue
            assert block.block_hash in self.hash_contents, f"{block}: content never computed"
            index, tokens = self.hash_contents[block.block_hash]
            for offset, token in enumerate(tokens):
                slot = block.block_id * BLOCK_SIZE + offset
                assert self.worker.kv[slot] == (index * BLOCK_SIZE + offset, token), block


def assert_all_blocks_free(scheduler: Scheduler) -> None:
    kv = scheduler.kv_cache_manager
    assert scheduler.get_num_unfinished_requests() == 0
    assert scheduler.num_free_blocks == scheduler.ctx.num_kv_blocks
    assert all(block.ref_cnt == 0 for block in kv.block_pool.blocks)
    assert kv.usage == 0.0


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_SIZE) for _ in range(length)]


# -- scenarios -----------------------------------------------------------------------


def test_plain_run_matches_reference() -> None:
    sim = Sim(make_scheduler(max_num_batched_tokens=128))
    prompts = {f"r{i}": prompt_of(3 + 5 * i, i) for i in range(5)}
    for request_id, prompt in prompts.items():
        sim.add(request_id, prompt, max_tokens=9)
    sim.run()
    for request_id, prompt in prompts.items():
        assert sim.outputs[request_id] == reference_tokens(prompt, 9)
        assert sim.finish_reasons[request_id] == "length"
    assert sim.worker.num_partial_chunks == 0


def test_second_identical_prompt_hits_the_prefix_cache() -> None:
    sim = Sim(make_scheduler())
    prompt = prompt_of(10, 1)
    sim.add("a", prompt)
    sim.run()
    sim.scheduler.make_stats()  # reset the counters
    sim.add("b", prompt)
    out = sim.step()
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 8 and out.num_scheduled_tokens["b"] == 2
    stats = sim.scheduler.make_stats()
    assert (stats.prefix_cache.queries, stats.prefix_cache.hits) == (10, 8)
    sim.run()
    assert sim.outputs["b"] == sim.outputs["a"] == reference_tokens(prompt, 8)
    assert all(core.num_cached_tokens == 8 for core in sim.core_outputs["b"])
    assert all(core.num_cached_tokens == 0 for core in sim.core_outputs["a"])


def test_identical_prompts_and_siblings_share_blocks_in_the_same_step() -> None:
    sim = Sim(make_scheduler())
    prompt = prompt_of(10, 2)
    sim.add("a", prompt)
    sim.add("b", prompt)  # an identical prompt from another client
    sim.add("a-1", prompt, temperature=0.0)  # an n > 1 sibling (the front end splits n)
    out = sim.step()
    new = {n.req_id: n for n in out.scheduled_new_reqs}
    assert [new[r].num_computed_tokens for r in ("a", "b", "a-1")] == [0, 8, 8]
    assert new["a"].block_ids[:2] == new["b"].block_ids[:2] == new["a-1"].block_ids[:2]
    assert len({new[r].block_ids[2] for r in new}) == 3  # the partial block is private
    blocks = sim.scheduler.kv_cache_manager.get_blocks("a")
    assert [block.ref_cnt for block in blocks] == [3, 3, 1]
    assert out.total_num_scheduled_tokens == 10 + 2 + 2
    sim.run()
    assert sim.outputs["a"] == sim.outputs["b"] == sim.outputs["a-1"]
    assert sim.outputs["a"] == reference_tokens(prompt, 8)


def test_chunked_prefill_gives_the_same_tokens() -> None:
    sim = Sim(make_scheduler(max_num_batched_tokens=5))
    prompts = {"a": prompt_of(13, 3), "b": prompt_of(7, 4), "c": prompt_of(22, 5)}
    for request_id, prompt in prompts.items():
        sim.add(request_id, prompt, max_tokens=6)
    sim.run()
    for request_id, prompt in prompts.items():
        assert sim.outputs[request_id] == reference_tokens(prompt, 6)
    assert sim.worker.num_partial_chunks >= 4


def test_without_chunked_prefill_a_prompt_waits_for_the_whole_budget() -> None:
    scheduler = make_scheduler(
        max_num_batched_tokens=32, max_model_len=32, enable_chunked_prefill=False
    )
    sim = Sim(scheduler)
    sim.add("a", prompt_of(20, 6), max_tokens=10)
    sim.add("b", prompt_of(12, 7), max_tokens=4)
    sim.add("c", prompt_of(30, 8), max_tokens=2)  # never split: waits for a free budget
    sim.run()
    first_chunk: dict[str, int] = {}
    for out in sim.steps:
        for new in out.scheduled_new_reqs:
            first_chunk.setdefault(new.req_id, out.num_scheduled_tokens[new.req_id])
    assert first_chunk == {"a": 20, "b": 12, "c": 30}
    assert sim.worker.num_partial_chunks == 0
    assert sim.outputs["c"] == reference_tokens(prompt_of(30, 8), 2)
    with pytest.raises(ValueError, match="chunked prefill disabled"):
        make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)


def test_preemption_by_recompute_gives_the_same_tokens() -> None:
    # 6 blocks hold 24 tokens: one request fits, four do not.
    sim = Sim(make_scheduler(num_kv_blocks=6, max_model_len=24))
    prompts = {f"r{i}": prompt_of(5 + i, 10 + i) for i in range(4)}
    for request_id, prompt in prompts.items():
        sim.add(request_id, prompt, max_tokens=12)
    sim.run()
    preempted = set().union(*(out.preempted_req_ids for out in sim.steps))
    assert preempted
    resumed = [n for out in sim.steps for n in out.scheduled_new_reqs if n.output_token_ids]
    assert resumed  # a preempted request comes back in full, with its output so far
    for request_id, prompt in prompts.items():
        assert sim.outputs[request_id] == reference_tokens(prompt, 12)


def test_preemption_stats_and_waiting_admission_pause() -> None:
    sim = Sim(make_scheduler(num_kv_blocks=6, max_model_len=24))
    for i in range(4):
        sim.add(f"r{i}", prompt_of(6, 20 + i), max_tokens=12)
    num_preempted = 0
    while sim.scheduler.has_unfinished_requests():
        out = sim.step()
        if out.preempted_req_ids:
            assert not out.scheduled_new_reqs  # no admission in a step that preempted
        num_preempted += sim.scheduler.make_stats().num_preempted_reqs
    assert num_preempted == sum(len(out.preempted_req_ids) for out in sim.steps) > 0
    sim.run()


class PreemptOldest(SchedulingPolicy):
    """Victim: the earliest admitted running request (already scheduled in the step)."""

    name = "preempt_oldest"

    def sort_key(self, request: RequestView) -> tuple[Any, ...]:
        return (request.arrival_time,)

    def select_preemption_victim(self, running: Sequence[RequestView]) -> RequestView:
        return running[0]


def test_preempting_a_request_scheduled_earlier_in_the_step() -> None:
    # Blocks hashed at allocation for a step that is then cancelled for the victim must
    # leave the cache: their KV is never written. Pool: 5 blocks; v re-computes its second
    # prompt block (the hit stops before the last token), which stays unhashed (a's
    # equal block is cached), so on v's preemption that block, not the stale one, is reused.
    sim = Sim(make_scheduler(PreemptOldest(policy_ctx()), num_kv_blocks=5, max_model_len=20))
    prompt = prompt_of(8, 30)
    sim.add("a", prompt, max_tokens=1)
    sim.run()
    sim.add("v", prompt, max_tokens=6)
    sim.add("r", prompt_of(5, 31), max_tokens=8)
    for _ in range(4):
        assert not sim.step().preempted_req_ids
    out = sim.step()  # v's decode fills its third block, then r needs a block: v is the victim
    assert out.preempted_req_ids == {"v"} and set(out.num_scheduled_tokens) == {"r"}
    sim.run()  # Sim checks after every step that each cached block holds its content
    assert sim.outputs["v"] == reference_tokens(prompt, 6)
    assert sim.outputs["r"] == reference_tokens(prompt_of(5, 31), 8)


def test_aborts_of_waiting_running_and_unknown_requests() -> None:
    sim = Sim(make_scheduler(max_num_seqs=2))
    for i in range(4):
        sim.add(f"r{i}", prompt_of(6, 40 + i), max_tokens=20)
    sim.step()
    sim.step()
    assert sim.outputs["r0"] and not sim.outputs["r3"]
    free_before = sim.scheduler.num_free_blocks
    sim.abort(["r0", "r3", "nope"])  # running, waiting, unknown
    assert sim.scheduler.num_free_blocks > free_before  # r0's blocks freed at once
    assert sim.scheduler.has_finished_requests()
    out = sim.step()
    assert out.finished_req_ids == {"r0", "r3"}
    assert "r0" not in sim.worker.requests
    assert not sim.scheduler.has_finished_requests()
    sim.abort(["r0"])  # already finished: ignored
    assert not sim.scheduler.has_finished_requests()
    sim.run()
    assert sim.outputs["r1"] == reference_tokens(prompt_of(6, 41), 20)
    assert sim.finish_reasons == {"r0": "abort", "r3": "abort", "r1": "length", "r2": "length"}
    with pytest.raises(ValueError, match="FINISHED_"):
        sim.scheduler.finish_requests(["r1"], RequestStatus.RUNNING)


def test_abort_of_a_preempted_request() -> None:
    sim = Sim(make_scheduler(num_kv_blocks=6, max_model_len=24))
    for i in range(3):
        sim.add(f"r{i}", prompt_of(8, 50 + i), max_tokens=14)
    while not any(out.preempted_req_ids for out in sim.steps):
        sim.step()
    (victim,) = sim.steps[-1].preempted_req_ids
    request = sim.scheduler.get_request(victim)
    assert request is not None and request.status is RequestStatus.PREEMPTED
    assert sim.scheduler.kv_cache_manager.get_block_ids(victim) == []
    sim.abort([victim])
    sim.run()
    assert sim.finish_reasons[victim] == "abort"


def test_token_budget_and_max_num_seqs_are_reached_not_exceeded() -> None:
    sim = Sim(make_scheduler(max_num_seqs=3, max_num_batched_tokens=10))
    for i in range(8):
        sim.add(f"r{i}", prompt_of(2 + i, 60 + i), max_tokens=5)
    sim.run()  # Sim.check_step asserts the limits on every SchedulerOutput
    assert sim.max_num_scheduled_reqs == 3
    assert max(out.total_num_scheduled_tokens for out in sim.steps) == 10


def test_reset_prefix_cache_and_stats() -> None:
    sim = Sim(make_scheduler())
    prompt = prompt_of(12, 70)
    sim.add("a", prompt)
    sim.step()
    assert sim.scheduler.reset_prefix_cache() is False  # a holds blocks
    stats = sim.scheduler.make_stats()
    assert stats.num_running_reqs == 1 and stats.prefix_cache.reset
    assert stats.num_total_blocks == 64 and stats.kv_cache_usage == pytest.approx(3 / 64)
    sim.run()
    assert sim.scheduler.reset_prefix_cache() is True
    sim.add("b", prompt)
    assert sim.step().scheduled_new_reqs[0].num_computed_tokens == 0
    sim.run()


# -- randomized stress ---------------------------------------------------------------


class RandomPolicy(SchedulingPolicy):
    """Random order and random victims: reaches every preemption path."""

    name = "random"

    def __init__(self, ctx: SchedulingPolicyContext, seed: int) -> None:
        super().__init__(ctx)
        self.rng = random.Random(seed)

    def sort_key(self, request: RequestView) -> tuple[Any, ...]:
        return (self.rng.random(),)

    def select_preemption_victim(self, running: Sequence[RequestView]) -> RequestView:
        return self.rng.choice(list(running))


@pytest.mark.parametrize("seed", range(6))
def test_randomized_stress(seed: int) -> None:
    rng = random.Random(seed)
    policies: list[SchedulingPolicy | None] = [
        None,
        PriorityPolicy(policy_ctx()),
        PreemptOldest(policy_ctx()),
        RandomPolicy(policy_ctx(), seed),
    ]
    scheduler = make_scheduler(
        policies[seed % len(policies)],
        num_kv_blocks=12,
        max_model_len=48,
        max_num_seqs=rng.choice([3, 8, 16]),
        max_num_batched_tokens=rng.choice([6, 16, 48]),
        enable_prefix_caching=seed % 3 != 2,
    )
    sim = Sim(scheduler)
    prefixes = [prompt_of(rng.randrange(1, 14), 100 + i) for i in range(3)]
    prompts: dict[str, list[int]] = {}
    max_tokens: dict[str, int] = {}

    def add_some(step_index: int) -> None:
        for _ in range(rng.choice([0, 0, 1, 3])):
            request_id = f"s{len(prompts)}"
            prompt = rng.choice(prefixes) + prompt_of(rng.randrange(0, 12), rng.randrange(10**9))
            prompt = prompt[:40] or [1]
            prompts[request_id] = prompt
            max_tokens[request_id] = rng.randrange(1, 49 - len(prompt))
            sim.add(
                request_id, prompt, max_tokens=max_tokens[request_id], priority=rng.randrange(3)
            )
        if step_index < 150 and sim.live_ids and rng.random() < 0.1:
            sim.abort(rng.sample(sorted(sim.live_ids), k=1))

    for step_index in range(150):
        add_some(step_index)
        sim.step()
    sim.run()
    assert len(prompts) > 50
    for request_id, prompt in prompts.items():
        expected = reference_tokens(prompt, max_tokens[request_id])
        if sim.finish_reasons[request_id] == "abort":
            assert sim.outputs[request_id] == expected[: len(sim.outputs[request_id])]
        else:
            assert sim.outputs[request_id] == expected
