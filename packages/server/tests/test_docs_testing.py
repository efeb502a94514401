"""docs/plugins/testing.md: its policy passes the page's tests, in and out of process.

The page's module is written to a temporary ``acme_plugins`` package beside a
``.dist-info`` declaring its ``engine.scheduling_policies`` entry, as ``pip install -e .``
of the page's distribution would; the directory is on ``sys.path`` (so a spawned
EngineCore finds it too) and on ``PYTHONPATH`` for the page's ``engine serve``. Its unit,
engine and server tests run as written, and the page's claims are checked: a spy sees no
call while EngineCore runs in its own process (the same tokens all the same), and the
fixture table names every fixture ``pytest -p engine.testing`` provides.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import engine.testing
from engine.core import LLM, SamplingParams
from engine.sdk.groups import SCHEDULING_POLICIES
from engine.testing.docs import PLUGIN_DOCS, code_block, page_package, run_page_tests
from engine.testing.engine import tokens_and_cached

PAGE = "testing.md"
MODULE = "# src/acme_plugins/oldest_first.py"
UNIT, ENGINE, SERVER = ("# tests/test_oldest_first.py", "# tests/test_oldest_first_engine.py",
                        "# tests/test_oldest_first_server.py")
VALUE = "acme_plugins.oldest_first:OldestFirst"


@pytest.fixture(scope="module")
def acme(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The page's package and its entry point, installed on ``sys.path``."""
    root = tmp_path_factory.mktemp("docs")
    info = root / "acme_engine_plugins-0.3.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: acme-engine-plugins\nVersion: 0.3.0\n")
    (info / "entry_points.txt").write_text(f"[{SCHEDULING_POLICIES}]\noldest_first = {VALUE}\n")
    with page_package(root, "acme_plugins", {"oldest_first": code_block(PAGE, MODULE)}):
        yield root


@pytest.fixture
def installed(acme: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every installed plugin allowed; processes started by the test see the package too."""
    page = " ".join((PLUGIN_DOCS / PAGE).read_text().split())
    assert (f'registered as `oldest_first = "{VALUE}"` under '
            f'`[project.entry-points."{SCHEDULING_POLICIES}"]`') in page
    monkeypatch.delenv("ENGINE_PLUGINS", raising=False)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(acme), os.environ.get("PYTHONPATH")) if p))
    return acme


def test_the_pages_unit_tests_pass(acme: Path) -> None:
    assert run_page_tests(code_block(PAGE, UNIT), "test_oldest_first.py") == [
        "test_oldest_first_and_the_cap_from_the_options",
        "test_a_bad_option_is_refused_as_the_engine_would"]


def test_the_pages_engine_test_passes(installed: Path, tiny_llama_checkpoint: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    assert run_page_tests(code_block(PAGE, ENGINE), "test_oldest_first_engine.py",
                          tiny_llama_checkpoint=tiny_llama_checkpoint,
                          monkeypatch=monkeypatch) == [
        "test_the_engine_orders_requests_with_the_policy"]


def test_a_spy_sees_no_call_while_engine_core_runs_in_its_own_process(
        installed: Path, tiny_llama_checkpoint: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from acme_plugins.oldest_first import OldestFirst

    calls: list[str] = []
    sort_key = OldestFirst.sort_key

    def spy(self: Any, request: Any) -> tuple[Any, ...]:
        calls.append(request.request_id)
        return sort_key(self, request)

    monkeypatch.setattr(OldestFirst, "sort_key", spy)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    common: dict[str, Any] = {"dtype": "float32", "num_kv_blocks": 32,
                              "scheduling_policy": "oldest_first"}
    with LLM(str(tiny_llama_checkpoint), **common) as spawned:  # EngineCore: another process
        tokens, _ = tokens_and_cached(spawned, prompts, greedy)
    assert calls == []
    with LLM(str(tiny_llama_checkpoint), in_process=True, **common) as llm:
        assert tokens_and_cached(llm, prompts, greedy)[0] == tokens
    assert len(calls) == len(prompts)


def test_the_pages_server_tests_pass(installed: Path, tiny_llama_checkpoint: Path) -> None:
    assert run_page_tests(code_block(PAGE, SERVER), "test_oldest_first_server.py",
                          tiny_llama_checkpoint=tiny_llama_checkpoint) == [
        "test_the_server_serves_with_the_policy",
        "test_a_bad_option_stops_the_server_before_it_serves"]


def test_the_page_names_every_fixture_of_the_pytest_plugin() -> None:
    page = (PLUGIN_DOCS / PAGE).read_text()
    fixtures = [name for name, value in inspect.getmembers(engine.testing)
                if hasattr(value, "_fixture_function_marker")
                or type(value).__name__ == "FixtureFunctionDefinition"]
    assert fixtures, "engine.testing provides no fixture: the check below checks nothing"
    assert [name for name in fixtures if f"`{name}`" not in page] == []
