"""acme_lru: the conformance suite, then an engine that reports cached tokens for a repeated
prompt, gives the same tokens, and keeps at most ``max_blocks`` blocks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from acme_engine_plugins.kv_lru import (
    SKIP_KEY,
    LRUConnector,
    LRUScheduler,
    LRUWorker,
    block_keys,
)

from engine.core import SamplingParams
from engine.testing.contracts import check_kv_connector
from engine.testing.engine import assert_kv_pool_full, tokens_and_cached

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_conforms() -> None:
    report = check_kv_connector(LRUConnector)
    assert report.num_external_tokens > 0  # it supplied tokens it had saved
    assert report.num_partial_chunks > 0 and report.num_preempted > 0


def test_conforms_when_it_must_evict() -> None:
    report = check_kv_connector(LRUConnector, options={"max_blocks": 3})
    assert report.num_external_tokens > 0


def test_keys_chain_the_prefix() -> None:
    a, b = block_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4), block_keys([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # same block, other prefix
    assert block_keys([1, 2, 3, 4, 5, 6, 7, 8], 4) == a


def llm_with(make_llm: Callable[..., Any], checkpoint: Path, **kwargs: Any) -> Any:
    # The engine's own prefix cache would serve the repeat first: off, so the store does.
    return make_llm(checkpoint, enable_prefix_caching=False, block_size=4, **kwargs)


def test_a_repeated_prompt_is_served_from_the_store(
    tiny_qwen3: Path, make_llm: Callable[..., Any], spy: Callable[..., Any],
) -> None:
    prompt = list(range(40, 58))  # 4 full blocks of 4, and 2 tokens
    with llm_with(make_llm, tiny_qwen3) as llm:
        [reference], [cached] = tokens_and_cached(llm, [prompt], GREEDY)
        assert cached == 0
    calls = spy(LRUWorker, "wait_for_layer_load")
    with llm_with(make_llm, tiny_qwen3, kv_connector="acme_lru") as llm:
        first, first_cached = tokens_and_cached(llm, [prompt], GREEDY)
        again, again_cached = tokens_and_cached(llm, [prompt], GREEDY)
        assert_kv_pool_full(llm)
    assert first == again == [reference]
    assert (first_cached, again_cached) == ([0], [16])  # every full block came from the store
    assert calls["wait_for_layer_load"] > 0


def test_it_keeps_at_most_max_blocks(
    tiny_qwen3: Path, make_llm: Callable[..., Any],
) -> None:
    prompt = list(range(40, 58))
    with llm_with(make_llm, tiny_qwen3, kv_connector="acme_lru",
                  kv_connector_options={"max_blocks": 2}) as llm:
        tokens_and_cached(llm, [prompt], GREEDY)
        _, cached = tokens_and_cached(llm, [prompt], GREEDY)
    assert cached == [8]  # the first two blocks of the chain: eviction trims from the end


def test_not_selected_it_is_never_built(
    tiny_qwen3: Path, make_llm: Callable[..., Any], spy: Callable[..., Any],
) -> None:
    calls = spy(LRUScheduler, "__init__")
    with llm_with(make_llm, tiny_qwen3) as llm:
        _, cached = tokens_and_cached(llm, [list(range(40, 58))] * 2, GREEDY)
    assert cached == [0, 0] and calls["__init__"] == 0


@pytest.mark.parametrize("bad", [{"max_blocks": 0}, {"max_block": 5}])
def test_bad_options_stop_start_up_naming_the_key(
    tiny_qwen3: Path, make_llm: Callable[..., Any], bad: dict[str, Any],
) -> None:
    with pytest.raises(Exception, match=next(iter(bad))):
        llm_with(make_llm, tiny_qwen3, kv_connector="acme_lru", kv_connector_options=bad)


def test_stat_loggers_see_the_stores_hits(
    tiny_qwen3: Path, make_llm: Callable[..., Any],
) -> None:
    from acme_engine_plugins.stats import JsonlRequestLogger

    loggers: list[JsonlRequestLogger] = []
    original = JsonlRequestLogger.__init__

    def keep(self: JsonlRequestLogger, ctx: Any) -> None:
        original(self, ctx)
        loggers.append(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(JsonlRequestLogger, "__init__", keep)
        with llm_with(make_llm, tiny_qwen3, kv_connector="acme_lru") as llm:
            prompt = list(range(40, 58))
            tokens_and_cached(llm, [prompt], GREEDY)
            _, cached = tokens_and_cached(llm, [prompt], GREEDY)
    assert cached == [16]
    [logger] = loggers
    assert (logger.prefix_cache_hits, logger.connector_hits) == (0, 16)  # the store's, once


def test_a_request_can_stay_out_of_the_store(
    tiny_qwen3: Path, make_llm: Callable[..., Any],
) -> None:
    from engine.sdk import ValidationError

    prompt = list(range(40, 58))
    private = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                             extra_args={SKIP_KEY: True})
    with llm_with(make_llm, tiny_qwen3, kv_connector="acme_lru") as llm:
        tokens_and_cached(llm, [prompt], private)
        _, cached = tokens_and_cached(llm, [prompt], GREEDY)
        assert cached == [0]  # the private run saved nothing
        _, cached = tokens_and_cached(llm, [prompt], private)
        assert cached == [0]  # and is served nothing (the last run saved it)
        _, cached = tokens_and_cached(llm, [prompt], GREEDY)
        assert cached == [16]
        with pytest.raises(ValidationError, match="acme_lru_skpi"):  # a key no plugin takes
            tokens_and_cached(llm, [prompt], SamplingParams(extra_args={"acme_lru_skpi": 1}))
