"""docs/plugins/schedulers.md: its policy and scheduler pass the page's tests and serve.

The page's modules (``# src/acme_plugins/policy.py``, ``reserving.py``) are written to a
temporary ``acme_plugins`` package; its two test blocks run as written (the conformance
suite on the scheduler, the policy's unit tests and the default scheduler with the
policy); then both are selected in a real engine on the tiny test checkpoint the way
"Selecting and configuring" says, and the constructor's refusal reads as "Failures" shows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.core import LLM
from engine.sdk import PluginError, SamplingParams, ValidationError
from engine.sdk.groups import SCHEDULERS, SCHEDULING_POLICIES
from engine.testing.docs import PLUGIN_DOCS, code_block, page_package, run_page_tests
from engine.testing.engine import assert_kv_pool_full
from engine.testing.test_plugins import entry_installer

PAGE = "schedulers.md"
POLICY, SCHEDULER = "# src/acme_plugins/policy.py", "# src/acme_plugins/reserving.py"
SCHEDULER_TEST = "# tests/test_schedulers.py"
POLICY_TEST = "# tests/test_policy.py"
PROMPTS = [list(range(3, 40)), [5, 9, 4, 7] * 3, list(range(100, 110))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def acme(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    modules = {"policy": code_block(PAGE, POLICY), "reserving": code_block(PAGE, SCHEDULER)}
    with page_package(tmp_path_factory.mktemp("docs"), "acme_plugins", modules) as root:
        yield root


@pytest.fixture
def install(monkeypatch: pytest.MonkeyPatch) -> Callable[[str, str, type], None]:
    """``install(group, name, cls)``: the engine discovers ``cls`` as an installed entry."""
    return entry_installer(monkeypatch, "acme-engine-plugins", "0.3.0")


def test_the_scheduler_passes_the_pages_conformance_test(acme: Path) -> None:
    assert run_page_tests(code_block(PAGE, SCHEDULER_TEST)) == [
        "test_reserving_scheduler_conforms"]


def test_the_policy_passes_the_pages_tests(acme: Path) -> None:
    assert run_page_tests(code_block(PAGE, POLICY_TEST)) == [
        "test_policy_orders_admits_and_preempts",
        "test_default_scheduler_with_the_policy_conforms"]


def greedy(llm: LLM) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def tiny(path: Path, **kwargs: object) -> LLM:
    options: dict[str, object] = {"num_kv_blocks": 32, "block_size": 4, "max_model_len": 64,
                                  **kwargs}
    return LLM(str(path), dtype="float32", in_process=True, **options)


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> list[list[int]]:
    with tiny(tiny_llama, plugins="none") as llm:
        return greedy(llm)


def test_the_reserving_scheduler_serves_the_engine(
        acme: Path, install: Callable[[str, str, type], None], tiny_llama: Path,
        reference: list[list[int]]) -> None:
    from acme_plugins.reserving import ReservingScheduler

    install(SCHEDULERS, "reserving", ReservingScheduler)
    # --scheduler reserving; a 16-token budget makes the 37-token prompt run in chunks.
    with tiny(tiny_llama, scheduler="reserving", max_num_batched_tokens=16) as llm:
        assert isinstance(llm.llm_engine.core.scheduler, ReservingScheduler)
        assert greedy(llm) == reference
        assert_kv_pool_full(llm)


def test_the_policy_is_selected_with_its_options(
        acme: Path, install: Callable[[str, str, type], None], tiny_llama: Path,
        reference: list[list[int]]) -> None:
    from acme_plugins.policy import ShortestPromptFirst

    install(SCHEDULING_POLICIES, "shortest_prompt_first", ShortestPromptFirst)
    with tiny(tiny_llama, scheduling_policy="shortest_prompt_first",
              plugin_options={"shortest_prompt_first": {"max_running": 1}}) as llm:
        policy = llm.llm_engine.core.scheduler.policy
        assert isinstance(policy, ShortestPromptFirst)
        assert isinstance(policy.options, ShortestPromptFirst.Options)
        assert policy.options.max_running == 1
        assert greedy(llm) == reference  # one at a time, shortest prompt first: same tokens
        # The key the policy declares is accepted (and changes only the order)...
        urgent = GREEDY.replace(extra_args={"urgent": True})
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                               [GREEDY, urgent, GREEDY], use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == reference
        # ...and a misspelt one is refused, naming the key the policy takes.
        with pytest.raises(ValidationError, match=r"'urgnet' is not taken .* 'urgent' by "
                           r"scheduling policy 'shortest_prompt_first' \(acme-engine-plugins"):
            llm.generate(PROMPTS[0], GREEDY.replace(extra_args={"urgnet": True}),
                         use_tqdm=False)
        assert_kv_pool_full(llm)


def test_the_constructors_refusal_is_the_failure_the_page_shows(
        acme: Path, install: Callable[[str, str, type], None], tiny_llama: Path,
        tmp_path: Path) -> None:
    from acme_plugins.reserving import ReservingScheduler

    install(SCHEDULERS, "reserving", ReservingScheduler)
    page = " ".join((PLUGIN_DOCS / PAGE).read_text().split())
    cause = ("constructing it failed: ValidationError: the reserving scheduler cannot use a "
             "KV connector")
    assert f"`{cause}`" in page
    with pytest.raises(PluginError, match=r"^plugin 'reserving' \(group engine.schedulers, "
                       r"distribution acme-engine-plugins 0.3.0\): ") as failure:
        tiny(tiny_llama, scheduler="reserving", kv_connector="offload",
             kv_connector_options={"path": str(tmp_path)})
    assert cause in str(failure.value)


def test_the_failures_the_page_shows_are_what_the_suite_says(acme: Path) -> None:
    import dataclasses

    from acme_plugins.reserving import ReservingScheduler

    from engine.testing.contracts import check_scheduler

    class AllBlocksAtOnce(ReservingScheduler):  # what this page's example used to do
        def _grow(self, r: Any, num_new_tokens: int) -> tuple[int, ...]:
            new, r.reserved = tuple(r.reserved), []
            r.block_ids.extend(new)
            return new

    class IgnoresTheBudget(ReservingScheduler):
        def schedule(self) -> Any:
            real = self.ctx
            self.ctx = dataclasses.replace(real, max_num_batched_tokens=1 << 20)
            try:
                return super().schedule()
            finally:
                self.ctx = real

    class ForgetsFinished(ReservingScheduler):
        def _free(self, r: Any) -> None:
            super()._free(r)
            self.finished_req_ids.discard(r.req.request_id)

    page = " ".join((PLUGIN_DOCS / PAGE).read_text().split())
    for broken, shown in [
        (AllBlocksAtOnce, "plain: plain-0: 3 blocks for 3 tokens"),
        (IgnoresTheBudget, "chunked prefill: 42 tokens scheduled, the budget is 5"),
        (ForgetsFinished, "plain: the worker still holds ['plain-0'"),
    ]:
        assert f"`{shown}" in page
        with pytest.raises(AssertionError) as failure:
            check_scheduler(broken)
        assert str(failure.value).startswith(shown), (broken.__name__, str(failure.value))
