"""docs/plugins/structured-outputs.md: every python block runs as written.

``from engine.core import LLM`` in a page block builds the tiny test checkpoint (in this
process) instead of the default model. The page's backend, ``acme_plugins/choices.py``, is
written to a temporary package, passes the page's tests and, installed as the page's entry
point would install it, serves a request (and only the constrained one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import engine.core
from engine.core import LLM
from engine.core.engine.engine_core import EngineCore
from engine.sdk import SamplingParams, ValidationError
from engine.sdk.groups import STRUCTURED_OUTPUT_BACKENDS
from engine.sdk.structured_output import StructuredOutputsParams
from engine.testing.docs import code_block, code_blocks, exec_block, page_package, run_page_tests
from engine.testing.engine import assert_kv_pool_full
from engine.testing.test_plugins import entry_installer

PAGE = "structured-outputs.md"
OFFLINE = "# offline_structured.py"
BACKEND = "# src/acme_plugins/choices.py"
OFFLINE_CHOICES = "# offline_choices.py"
TESTS = "# tests/test_choices.py"


def test_every_block_is_run() -> None:
    assert sorted(b.splitlines()[0] for b in code_blocks(PAGE)) == sorted(
        [OFFLINE, BACKEND, OFFLINE_CHOICES, TESTS])


@pytest.fixture(scope="module")
def acme(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    modules = {"choices": code_block(PAGE, BACKEND)}
    with page_package(tmp_path_factory.mktemp("docs"), "acme_plugins", modules) as root:
        yield root


@pytest.fixture
def install(monkeypatch: pytest.MonkeyPatch) -> Callable[[str, str, type], None]:
    """``install(group, name, cls)``: the engine discovers ``cls`` as an installed entry."""
    return entry_installer(monkeypatch, "acme-engine-plugins", "0.3.0")


def test_the_offline_example_runs(tiny_llm: Any) -> None:
    namespace = exec_block(code_block(PAGE, OFFLINE))  # its asserts check the outputs
    outputs = namespace["outputs"]
    assert [o.outputs[0].finish_reason for o in outputs[:3]] == ["stop"] * 3
    [llm] = tiny_llm.made
    assert core_of(llm).structured_output._matchers == {}


def test_the_backend_passes_the_pages_tests(acme: Path, tmp_path: Path) -> None:
    assert run_page_tests(code_block(PAGE, TESTS), "test_choices.py", tmp_path=tmp_path) == [
        "test_a_choice_is_spelled_then_ends", "test_other_kinds_are_refused_naming_the_field"]


def test_the_backend_serves_the_engine(acme: Path, install: Callable[[str, str, type], None],
                                       tiny_llm: Any) -> None:
    from acme_plugins.choices import ChoiceBackend

    install(STRUCTURED_OUTPUT_BACKENDS, "acme_choice", ChoiceBackend)
    exec_block(code_block(PAGE, OFFLINE_CHOICES))  # its asserts check the output
    [first] = tiny_llm.made
    choices = ("yes", "no", "maybe")
    plain = SamplingParams(temperature=0, max_tokens=8)
    with engine.core.LLM(structured_outputs_backend="acme_choice") as llm:
        [alone] = llm.generate("Hello", plain, use_tqdm=False)
        outs = llm.generate(["Will it rain? ", "Hello"], [SamplingParams(
            temperature=0, max_tokens=8,
            structured_outputs=StructuredOutputsParams(choice=choices)), plain],
            use_tqdm=False)
        assert outs[0].outputs[0].text in choices
        assert outs[1].outputs[0].token_ids == alone.outputs[0].token_ids
        with pytest.raises(ValidationError, match="structured_outputs.json is not served by "
                           "acme_choice; it serves structured_outputs.choice only"):
            llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(
                json={"type": "object"})), use_tqdm=False)
        with pytest.raises(ValidationError, match="acme_choice takes at most 64"):
            llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(
                choice=tuple(str(i) for i in range(65)))), use_tqdm=False)
        backend = core_of(llm).structured_output._backend
        assert isinstance(backend, ChoiceBackend)  # EngineCore's, built on first use
        assert_kv_pool_full(llm)
    first_backend = core_of(first).structured_output._backend
    assert isinstance(first_backend, ChoiceBackend)
    assert first_backend.options.max_choices == 16  # the page's plugin_options


def core_of(llm: LLM) -> EngineCore:
    core = llm.llm_engine.core
    assert isinstance(core, EngineCore)
    return core


def test_the_errors_shown_are_what_the_engine_says(tiny_llm: Any) -> None:
    from engine.testing.docs import PLUGIN_DOCS

    page = (PLUGIN_DOCS / PAGE).read_text()
    shown = page.split("## Errors", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    specs: list[dict[str, Any]] = [{"regex": "(ab"}, {"grammar": "root ::= foo"},
                                   {"json": {"type": "nope"}}, {"json_object": True, "regex": "a"}]
    said = []
    with engine.core.LLM() as llm:
        for spec in specs:
            with pytest.raises(ValidationError) as info:
                llm.generate("x", SamplingParams(
                    structured_outputs=StructuredOutputsParams(**spec)), use_tqdm=False)
            said.append(str(info.value))
    assert said == shown.splitlines()
