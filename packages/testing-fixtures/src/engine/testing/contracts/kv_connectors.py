"""Conformance suite for ``KVConnector`` plugins: run it against your own connector.

:func:`check_kv_connector` builds both sides of your connector for a series of small
simulated engines, each driven by the engine's own default scheduler and a fake worker
that keeps real KV tensors and runs your worker side exactly as the engine does (see
``engine.testing.contracts._kv_sim``). Every KV element is a function of its layer and
of the tokens up to its position, and the fake model samples from the context, so a block
loaded into the wrong place, loaded after its layer read it, or stored under the wrong key
fails with the position that is wrong; tokens must equal a run without any cache, and
after every scenario every KV block must be free again.

Usage, in the connector's own tests (pytest)::

    from engine.testing.contracts import check_kv_connector
    from my_pkg.connector import MyConnector


    def test_my_connector_conforms(tmp_path) -> None:
        report = check_kv_connector(MyConnector, options={"path": str(tmp_path)})
        assert report.num_external_tokens > 0

A connector that is not a store (e.g. one that only sends KV to another engine) passes
``expect_hits=False``.

.. versionadded:: 1.1
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from engine.sdk.kv_connector import KVConnector
from engine.sdk.plugin import PluginOptions, check_contract_version
from engine.testing.contexts import plugin_options
from engine.testing.contracts._kv_sim import KVConnectorDriver, KVSimConfig
from engine.testing.contracts._scheduler_sim import FAKE_VOCAB_SIZE, reference_tokens

__all__ = ["KVConnectorReport", "check_kv_connector"]


@dataclass(frozen=True)
class KVConnectorReport:
    """What a passing :func:`check_kv_connector` run covered.

    Attributes:
        scenarios: The scenarios run, in order.
        num_requests: Requests run to completion or aborted.
        num_steps: ``schedule()`` calls.
        num_external_tokens: Tokens the connector supplied (``num_external_tokens`` of
            every ``update_state_after_alloc``).
        num_async_loads: Admissions whose tokens loaded asynchronously.
        num_aborted_while_loading: Requests aborted before their asynchronous load ended.
        num_preempted: Preemptions.
        num_partial_chunks: Steps that computed only part of a prompt.
        num_second_engine_tokens: Tokens supplied to a second engine started after the
            first stopped (only a store that outlives an engine supplies any).
    """

    scenarios: tuple[str, ...]
    num_requests: int
    num_steps: int
    num_external_tokens: int
    num_async_loads: int
    num_aborted_while_loading: int
    num_preempted: int
    num_partial_chunks: int
    num_second_engine_tokens: int


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(FAKE_VOCAB_SIZE) for _ in range(length)]


def _check_tokens(driver: KVConnectorDriver, prompts: Mapping[str, list[int]],
                  max_tokens: int, scenario: str) -> None:
    for request_id, prompt in prompts.items():
        expected = reference_tokens(prompt, max_tokens)
        got = driver.outputs[request_id]
        if driver.finish_reasons.get(request_id) == "abort":
            expected = expected[:len(got)]
        assert got == expected, (
            f"{scenario}: {request_id} generated {got}, the model without any cache gives "
            f"{expected}")


def _run(driver: KVConnectorDriver, prompts: Mapping[str, list[int]], scenario: str,
         max_tokens: int = 6) -> None:
    for request_id, prompt in prompts.items():
        driver.add(request_id, prompt, max_tokens=max_tokens)
    driver.run()
    _check_tokens(driver, prompts, max_tokens, scenario)


def _prompts(tag: str, seed: int) -> dict[str, list[int]]:
    """Prompts sharing prefixes: full blocks, a partial block, one block, an extension."""
    base = _prompt(18, seed)
    return {f"{tag}-base": base, f"{tag}-short": base[:9],
            f"{tag}-long": base + _prompt(9, seed + 1), f"{tag}-other": _prompt(13, seed + 2),
            f"{tag}-exact": base[:16]}


@dataclass
class _Run:
    """Everything one :func:`check_kv_connector` call accumulates."""

    connector: type[KVConnector]
    options: PluginOptions
    config: KVSimConfig
    drivers: list[KVConnectorDriver]
    names: list[str]
    aborted_while_loading: int = 0
    second_engine_tokens: int = 0

    def engine(self, name: str, **changes: Any) -> KVConnectorDriver:
        driver = KVConnectorDriver.start(self.connector, self.options,
                                         replace(self.config, **changes))
        self.drivers.append(driver)
        self.names.append(name)
        return driver


def _misses_then_hits(run: _Run, expect_hits: bool) -> None:
    driver = run.engine("misses, then hits after the local prefix cache is dropped")
    unrelated = {f"miss-{i}": _prompt(6 + 5 * i, 1 + i) for i in range(4)}
    _run(driver, unrelated, "misses")
    assert driver.spy.num_external_tokens == 0, (
        f"misses: the connector supplied {driver.spy.num_external_tokens} tokens for prompts "
        f"it never saw")
    assert driver.scheduler.reset_prefix_cache(), "blocks still held after the misses"
    _run(driver, {f"again-{k}": v for k, v in unrelated.items()}, "hits")
    if expect_hits:
        assert driver.spy.num_external_tokens > 0, (
            "hits: the connector supplied no tokens for prompts it had seen (and whose "
            "blocks left the local prefix cache); pass expect_hits=False for a connector "
            "that is not a store")
    _run(driver, _prompts("shared", 3), "shared prefixes in one batch")
    driver.shutdown()


def _second_engine(run: _Run) -> None:
    first = run.engine("a second engine after the first stopped")
    prompts = _prompts("second", 11)
    _run(first, prompts, "second engine: first run")
    first.shutdown()
    second = run.engine("a second engine (its run)")
    _run(second, {f"again-{k}": v for k, v in prompts.items()}, "second engine")
    run.second_engine_tokens += second.spy.num_external_tokens
    second.shutdown()


def _chunked(run: _Run) -> None:
    driver = run.engine("chunked prefill (budget 5)", max_num_batched_tokens=5)
    prompts = _prompts("chunk", 21)
    _run(driver, prompts, "chunked prefill")
    driver.scheduler.reset_prefix_cache()
    _run(driver, {f"again-{k}": v for k, v in prompts.items()}, "chunked prefill, again")
    driver.shutdown()


def _aborts(run: _Run) -> None:
    driver = run.engine("aborts (while loading, running and waiting)", max_num_seqs=3)
    prompts = _prompts("abort", 31)
    _run(driver, prompts, "aborts: filling the store")
    driver.scheduler.reset_prefix_cache()
    again = {f"again-{k}": v for k, v in prompts.items()}
    for request_id, prompt in again.items():
        driver.add(request_id, prompt, max_tokens=6)
    driver.step()  # admission: loads start (asynchronous ones stay in flight)
    scheduled = {r for out in driver.steps[-1:] for r in out.num_scheduled_tokens}
    loading = driver.spy.async_admissions - scheduled
    victims = ["again-abort-base", "again-abort-other", "again-abort-exact"]
    run.aborted_while_loading += len(loading & set(victims))
    driver.abort(victims)
    driver.run()
    _check_tokens(driver, again, 6, "aborts")
    driver.shutdown()


def _preemption(run: _Run) -> None:
    driver = run.engine("preemption (8 blocks of 4 tokens)", num_kv_blocks=8, max_model_len=32)
    prompts = {f"pre-{i}": _prompt(9, 41) + _prompt(i, 42 + i) for i in range(4)}
    _run(driver, prompts, "preemption: filling the store", max_tokens=12)
    driver.scheduler.reset_prefix_cache()
    _run(driver, {f"again-{k}": v for k, v in prompts.items()}, "preemption", max_tokens=12)
    driver.shutdown()


def _churn(run: _Run, seed: int) -> None:
    rng = random.Random(seed)
    driver = run.engine(f"random churn (seed {seed})", num_kv_blocks=16, max_model_len=40,
                        max_num_seqs=rng.choice([2, 4, 8]),
                        max_num_batched_tokens=rng.choice([5, 12, 40]))
    prefixes = [_prompt(rng.randrange(4, 17), 100 + seed * 7 + i) for i in range(3)]
    prompts: dict[str, list[int]] = {}
    for step in range(120):
        for _ in range(rng.choice([0, 0, 1, 2])):
            request_id = f"c{len(prompts)}"
            prompt = rng.choice(prefixes) + _prompt(rng.randrange(6), rng.randrange(10**9))
            prompts[request_id] = prompt
            driver.add(request_id, prompt, max_tokens=6)
        if driver.live_ids and rng.random() < 0.08:
            driver.abort(rng.sample(sorted(driver.live_ids), k=1))
        if step % 30 == 29:
            driver.scheduler.reset_prefix_cache()
        driver.step()
    driver.run()
    _check_tokens(driver, prompts, 6, f"random churn (seed {seed})")
    driver.shutdown()


#: The scenarios after misses/hits, each on new engines (a store's content may carry over).
_SCENARIOS: list[Callable[[_Run], None]] = [_second_engine, _chunked, _aborts, _preemption]


def check_kv_connector(connector: type[KVConnector], *,
                       options: Mapping[str, Any] | PluginOptions | None = None,
                       expect_hits: bool = True, seeds: range = range(2),
                       config: KVSimConfig | None = None) -> KVConnectorReport:
    """Run every scenario against fresh sides of ``connector``.

    Scenarios (each a new simulated engine, all with the same ``options``, so a store
    outlives an engine only if the connector's does): misses on prompts never seen, then
    the same prompts again after the local prefix cache was dropped (hits expected unless
    ``expect_hits=False``); a second engine after the first stopped (its hits are reported,
    not required); chunked prefill under a 5-token budget; aborts of requests whose
    (asynchronous) load is in flight, of running and of waiting ones; preemption in an
    8-block pool; random arrivals, aborts and prefix-cache resets once per seed.

    Checked throughout: what the default scheduler checks of a connector (return types,
    metadata class); metadata surviving ``to_bytes``/``from_bytes``; every KV read of every
    layer returning what computing it would have written; tokens equal to the model's
    without any cache; after each scenario nothing unfinished, no block held for a
    transfer, and every KV block free.

    Args:
        connector: The ``KVConnector`` class (what your entry point names).
        options: Its options (a mapping validated by ``connector.Options``, or an instance).
            A store on disk needs a fresh, empty location for each call.
        expect_hits: Require tokens to be supplied for prompts seen before.
        seeds: Seeds of the random-churn scenario.
        config: The simulated engine (default :class:`KVSimConfig`: block size 4, two
            layers of two KV heads of four elements, float32).

    Returns:
        What the run covered.

    Raises:
        AssertionError: naming the scenario and the broken rule, or the class is not a
            concrete connector for this SDK's major version.
        PluginError: the default scheduler found the connector breaking its contract.
    """
    for cls in (connector, connector.scheduler_cls, connector.worker_cls):
        missing = sorted(getattr(cls, "__abstractmethods__", ()))
        assert not missing, (f"{cls.__qualname__} leaves abstract methods unimplemented: "
                             f"{', '.join(missing)}")
    support = check_contract_version(connector)
    assert support, f"{connector.__qualname__}: {support.reason}"
    validated = plugin_options(connector, options)
    run = _Run(connector, validated, config or KVSimConfig(), [], [])
    _misses_then_hits(run, expect_hits)
    for scenario in _SCENARIOS:
        scenario(run)
    for seed in seeds:
        _churn(run, seed)
    drivers = run.drivers
    return KVConnectorReport(
        scenarios=tuple(run.names),
        num_requests=sum(len(d.outputs) for d in drivers),
        num_steps=sum(len(d.steps) for d in drivers),
        num_external_tokens=sum(d.spy.num_external_tokens for d in drivers),
        num_async_loads=sum(len(d.spy.async_admissions) for d in drivers),
        num_aborted_while_loading=run.aborted_while_loading,
        num_preempted=sum(d.num_preempted for d in drivers),
        num_partial_chunks=sum(d.worker.num_partial_chunks for d in drivers),
        num_second_engine_tokens=run.second_engine_tokens,
    )
