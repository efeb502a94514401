"""Conformance suite for ``SchedulerInterface`` plugins: run it against your own class.

:func:`check_scheduler` builds your scheduler for a series of small engines and drives
each one the way EngineCore does, against a fake worker that keeps a fake KV cache and a
fake model whose next token depends on the whole context (read back through your block
tables). Every request's tokens must equal what the model gives without any scheduler, so
a wrong block table, a bad prefix-cache hit, a lost preemption or a chunk scheduled twice
changes tokens and fails; after every scenario every KV block must be free again.

Usage, in the plugin's own test suite (pytest)::

    from engine.testing.contracts import check_scheduler
    from my_pkg.scheduler import MyScheduler


    def test_my_scheduler_conforms() -> None:
        report = check_scheduler(MyScheduler)
        assert report.num_preempted > 0  # optional: what the run covered

Pass a factory instead of the class for schedulers that need more than the context
(``check_scheduler(lambda ctx: MyScheduler(ctx, table=...))``).
:class:`SchedulerDriver`, the same harness, is public for scenarios of your own.

.. versionadded:: 1.0
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Union

from engine.sdk.plugin import check_contract_version
from engine.sdk.scheduler import SchedulerContext, SchedulerInterface
from engine.testing.contracts._scheduler_sim import (
    FAKE_VOCAB_SIZE,
    SchedulerDriver,
    reference_tokens,
)

__all__ = ["SchedulerFactory", "SchedulerReport", "check_scheduler"]

#: The scheduler under test: its class, or ``factory(ctx) -> scheduler``.
SchedulerFactory = Union[type[SchedulerInterface], Callable[[SchedulerContext],
                                                            SchedulerInterface]]

#: The engine every scenario starts from (each changes a few fields).
BASE_CONTEXT = SchedulerContext(
    plugin_name="under_test", block_size=4, num_kv_blocks=64, max_num_seqs=16,
    max_num_batched_tokens=64, max_model_len=64)


@dataclass(frozen=True)
class SchedulerReport:
    """What a passing :func:`check_scheduler` run covered.

    Attributes:
        scenarios: The scenarios run, in order.
        num_requests: Requests run to completion or aborted.
        num_steps: ``schedule()`` calls.
        num_preempted: Preemptions (``SchedulerOutput.preempted_req_ids``).
        num_partial_chunks: Steps that computed only part of a prompt (chunked prefill).
        num_prefix_cache_hit_tokens: Prompt tokens reported as computed on admission
            (prefix-cache hits).
    """

    scenarios: tuple[str, ...]
    num_requests: int
    num_steps: int
    num_preempted: int
    num_partial_chunks: int
    num_prefix_cache_hit_tokens: int


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(FAKE_VOCAB_SIZE) for _ in range(length)]


def _assert_reference(driver: SchedulerDriver, prompts: dict[str, list[int]],
                      max_tokens: dict[str, int] | int, scenario: str) -> None:
    for request_id, prompt in prompts.items():
        wanted = max_tokens if isinstance(max_tokens, int) else max_tokens[request_id]
        expected = reference_tokens(prompt, wanted)
        got = driver.outputs[request_id]
        if driver.finish_reasons.get(request_id) == "abort":
            expected = expected[:len(got)]
        else:
            assert driver.finish_reasons.get(request_id) == "length", (
                f"{scenario}: {request_id} finished with "
                f"{driver.finish_reasons.get(request_id)!r}, expected 'length'")
        assert got == expected, (
            f"{scenario}: {request_id} generated {got}, the model without a scheduler "
            f"gives {expected}")


def _plain(driver: SchedulerDriver) -> None:
    prompts = {f"plain-{i}": _prompt(3 + 5 * i, i) for i in range(5)}
    for request_id, prompt in prompts.items():
        driver.add(request_id, prompt, max_tokens=9)
    driver.run()
    _assert_reference(driver, prompts, 9, "plain")


def _stop_conditions(driver: SchedulerDriver) -> None:
    prompt = _prompt(6, 11)
    tokens = reference_tokens(prompt, 12)
    driver.add("eos", prompt, max_tokens=12, eos_token_id=tokens[4])
    driver.add("ignore-eos", prompt, max_tokens=12, eos_token_id=tokens[4], ignore_eos=True)
    driver.add("stop-id", prompt, max_tokens=12, stop_token_ids=(tokens[6],))
    driver.add("min-tokens", prompt, max_tokens=12, eos_token_id=tokens[1], min_tokens=3)
    driver.run()
    # min_tokens 3: an EOS at index 1 does not stop; index 2 (which real sampling never
    # produces) is left out of the contract.
    assert tokens[2] != tokens[1], "pick another prompt: the min_tokens case is ambiguous"
    first_after_min = next((i for i in range(3, 12) if tokens[i] == tokens[1]), None)
    expected = {
        "eos": (tokens[:tokens.index(tokens[4]) + 1], "stop"),
        "ignore-eos": (tokens, "length"),
        "stop-id": (tokens[:tokens.index(tokens[6]) + 1], "stop"),
        "min-tokens": ((tokens[:first_after_min + 1], "stop") if first_after_min is not None
                       else (tokens, "length")),
    }
    for request_id, (want, reason) in expected.items():
        got = (driver.outputs[request_id], driver.finish_reasons.get(request_id))
        assert got == (want, reason), (
            f"stop conditions: {request_id} gave {got}, expected {(want, reason)} "
            f"(eos_token_id, ignore_eos, stop_token_ids and min_tokens are the scheduler's "
            f"to check in update_from_output)")


def _shared_prefixes(driver: SchedulerDriver) -> None:
    prompt = _prompt(10, 21)
    prompts = {"first": prompt, "same": prompt, "sibling": prompt,
               "longer": prompt + _prompt(5, 22)}
    for request_id, tokens in prompts.items():
        driver.add(request_id, tokens)
    driver.run()
    driver.add("again", prompt)  # after the others finished: cached blocks may be reused
    driver.run()
    _assert_reference(driver, {**prompts, "again": prompt}, 8, "shared prefixes")


def _chunked_prefill(driver: SchedulerDriver) -> None:
    prompts = {"a": _prompt(13, 31), "b": _prompt(7, 32), "c": _prompt(22, 33)}
    for request_id, prompt in prompts.items():
        driver.add(request_id, prompt, max_tokens=6)
    driver.run()
    _assert_reference(driver, prompts, 6, "chunked prefill (budget 5)")


def _preemption(driver: SchedulerDriver) -> None:
    prompts = {f"r{i}": _prompt(5 + i, 40 + i) for i in range(4)}
    for request_id, prompt in prompts.items():
        driver.add(request_id, prompt, max_tokens=12)
    driver.run()
    _assert_reference(driver, prompts, 12, "preemption (6 blocks of 4 tokens)")


def _aborts(driver: SchedulerDriver) -> None:
    prompts = {f"r{i}": _prompt(6, 50 + i) for i in range(4)}
    for request_id, prompt in prompts.items():
        driver.add(request_id, prompt, max_tokens=20)
    driver.step()
    driver.step()
    driver.abort(["r0", "r3", "never-added"])  # running, waiting (max_num_seqs 2), unknown
    out = driver.step()
    assert {"r0", "r3"} <= out.finished_req_ids, (
        f"aborts: the next step's finished_req_ids {sorted(out.finished_req_ids)} must "
        f"name the aborted requests so the worker drops them")
    driver.abort(["r0"])  # already finished: ignored
    driver.run()
    _assert_reference(driver, prompts, 20, "aborts")


def _random_churn(driver: SchedulerDriver, seed: int) -> None:
    rng = random.Random(seed)
    prefixes = [_prompt(rng.randrange(1, 14), 100 + i) for i in range(3)]
    prompts: dict[str, list[int]] = {}
    max_tokens: dict[str, int] = {}
    for step in range(150):
        for _ in range(rng.choice([0, 0, 1, 3])):
            request_id = f"s{len(prompts)}"
            prompt = (rng.choice(prefixes) + _prompt(rng.randrange(12), rng.randrange(10**9)))
            prompts[request_id] = prompt[:40] or [1]
            max_tokens[request_id] = rng.randrange(1, 49 - len(prompts[request_id]))
            driver.add(request_id, prompts[request_id], max_tokens=max_tokens[request_id],
                       priority=rng.randrange(3))
        if step < 150 and driver.live_ids and rng.random() < 0.1:
            driver.abort(rng.sample(sorted(driver.live_ids), k=1))
        driver.step()
    driver.run()
    _assert_reference(driver, prompts, max_tokens, f"random churn (seed {seed})")


#: ``(name, context changes, body)`` of every scenario.
_SCENARIOS: list[tuple[str, dict[str, Any], Callable[[SchedulerDriver], None]]] = [
    ("plain", {"max_num_batched_tokens": 128}, _plain),
    ("stop conditions", {}, _stop_conditions),
    ("shared prefixes", {}, _shared_prefixes),
    ("shared prefixes without prefix caching", {"enable_prefix_caching": False},
     _shared_prefixes),
    ("chunked prefill", {"max_num_batched_tokens": 5}, _chunked_prefill),
    ("preemption", {"num_kv_blocks": 6, "max_model_len": 24}, _preemption),
    ("aborts", {"max_num_seqs": 2}, _aborts),
]


def check_scheduler(factory: SchedulerFactory, *, seeds: range = range(3),
                    context: SchedulerContext | None = None) -> SchedulerReport:
    """Run every scenario against fresh schedulers made by ``factory``.

    Scenarios (each on a new scheduler): plain batch; stop conditions (EOS, ``ignore_eos``,
    ``stop_token_ids``, ``min_tokens``); identical and extended prompts, with and without
    prefix caching; chunked prefill under a 5-token budget; preemption in a 6-block pool;
    aborts of running, waiting, unknown and finished requests; then random arrivals,
    priorities and aborts in a 12-block pool with small budgets, once per seed.

    Checked throughout: the token budget and ``max_num_seqs``; new requests sent once and
    cached ones as consistent deltas; block tables covering exactly the computed tokens;
    no KV slot written twice in a step; every KV read returning the token it should;
    resumed requests carrying their output; finished and aborted ids reaching the worker;
    tokens equal to the model's without a scheduler; after each scenario, nothing
    unfinished and ``make_stats()`` reporting every block free.

    Args:
        factory: The scheduler class, or ``factory(ctx) -> scheduler``.
        seeds: Seeds of the random-churn scenario.
        context: The context scenarios start from (default :data:`BASE_CONTEXT`, block
            size 4); its ``policy`` and ``options`` reach your scheduler unchanged.

    Returns:
        What the run covered.

    Raises:
        AssertionError: naming the scenario and the broken rule, or the class is not a
            concrete scheduler for this SDK's major version.
    """
    if isinstance(factory, type):
        missing = sorted(getattr(factory, "__abstractmethods__", ()))
        assert not missing, (f"{factory.__qualname__} leaves abstract methods "
                             f"unimplemented: {', '.join(missing)}")
        support = check_contract_version(factory)
        assert support, f"{factory.__qualname__}: {support.reason}"
    base = context or BASE_CONTEXT
    drivers: list[SchedulerDriver] = []
    names: list[str] = []

    def run(name: str, changes: dict[str, Any], body: Callable[[SchedulerDriver], None],
            ) -> None:
        driver = SchedulerDriver(factory(replace(base, **changes)))
        try:
            body(driver)
        except AssertionError as exc:  # name the scenario (most step checks do not)
            message = str(exc)
            named = message.startswith((f"{name}:", f"{name} ("))
            raise AssertionError(message if named else f"{name}: {message}") from exc
        drivers.append(driver)
        names.append(name)

    for name, changes, body in _SCENARIOS:
        run(name, changes, body)
    for seed in seeds:
        rng = random.Random(seed)
        changes = {"num_kv_blocks": 12, "max_model_len": 48,
                   "max_num_seqs": rng.choice([3, 8, 16]),
                   "max_num_batched_tokens": rng.choice([6, 16, 48]),
                   "enable_prefix_caching": seed % 3 != 2}
        run(f"random churn (seed {seed})", changes,
            lambda driver, seed=seed: _random_churn(driver, seed))  # type: ignore[misc]
    return SchedulerReport(
        scenarios=tuple(names),
        num_requests=sum(len(d.outputs) for d in drivers),
        num_steps=sum(len(d.steps) for d in drivers),
        num_preempted=sum(d.num_preempted for d in drivers),
        num_partial_chunks=sum(d.worker.num_partial_chunks for d in drivers),
        num_prefix_cache_hit_tokens=sum(
            new.num_computed_tokens for d in drivers for out in d.steps
            for new in out.scheduled_new_reqs if not new.output_token_ids),
    )
