"""docs/plugins/models.md: the GPT-2 and Qwen2-MoE plugins serve transformers' greedy tokens.

The page's modules (``# src/acme_plugins/gpt2.py``, ``# src/acme_plugins/qwen2_moe.py``)
are written to a temporary ``acme_plugins`` package and installed as the ``engine.models``
entries the page registers (``GPT2LMHeadModel``, ``Qwen2MoeForCausalLM``); the page's tests
then run as written, with ``engine.core.LLM`` running in this process (where the entries
are installed). The models build every layer through ``ctx.layers``, the SDK's
``LayerFactory`` (Qwen2-MoE's routed experts through ``fused_moe``); their
``capture_support`` keeps the CPU step graph off with the INFO lines the page shows. The
page's Qwen2-MoE module is the model of the test plugin package engine-test-moe-model,
line for line (``test_moe_model_plugin.py`` runs that package on one rank and two).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import engine.core
from engine.core import LLM
from engine.core.plugins import PluginEntry, _catalog
from engine.core.plugins._local import plugin_reference
from engine.sdk import ModelContext, ValidationError
from engine.sdk.groups import MODELS
from engine.testing.docs import (
    code_block,
    code_blocks,
    exec_block,
    page_package,
    run_page_tests,
)
from engine.testing.test_plugins import PLUGINS_SOURCE, entry_installer

PAGE = "models.md"
MODULE, TEST = "# src/acme_plugins/gpt2.py", "# tests/test_gpt2.py"
ROPE = "# rope settings of either transformers era"
MOE_MODULE, MOE_TEST = "# src/acme_plugins/qwen2_moe.py", "# tests/test_qwen2_moe.py"
#: The model module of the test plugin package engine-test-moe-model: the page's MoE example.
MOE_PLUGIN = PLUGINS_SOURCE / "moe-model" / "src" / "engine_test_moe_model" / "qwen2_moe.py"


@pytest.fixture(scope="module")
def acme(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    modules = {"gpt2": code_block(PAGE, MODULE), "qwen2_moe": code_block(PAGE, MOE_MODULE)}
    with page_package(tmp_path_factory.mktemp("docs"), "acme_plugins", modules) as root:
        yield root


@pytest.fixture
def installed(acme: Path, monkeypatch: pytest.MonkeyPatch) -> type:
    """The page's entry point, as ``pip install -e .`` would install it."""
    from acme_plugins.gpt2 import GPT2LMHeadModel

    entry = PluginEntry(MODELS, "GPT2LMHeadModel", plugin_reference(GPT2LMHeadModel),
                        "acme-engine-plugins", "0.3.0")
    discover = _catalog.discover_entries
    monkeypatch.setattr(_catalog, "discover_entries", lambda: [*discover(), entry])
    return GPT2LMHeadModel


@pytest.fixture
def installed_moe(acme: Path, monkeypatch: pytest.MonkeyPatch) -> type:
    """The page's Qwen2-MoE entry point, as ``pip install -e .`` would install it."""
    from acme_plugins.qwen2_moe import Qwen2MoeForCausalLM

    add = entry_installer(monkeypatch, "acme-engine-plugins", "0.3.0")
    add(MODELS, "Qwen2MoeForCausalLM", Qwen2MoeForCausalLM)
    return Qwen2MoeForCausalLM


def shown_lines(start: str) -> list[str]:
    """The page's ``text`` blocks that start with ``start``."""
    return [b.strip() for b in code_blocks(PAGE, "text") if b.startswith(start)]


@pytest.fixture
def in_process_llm(monkeypatch: pytest.MonkeyPatch) -> list[LLM]:
    """``from engine.core import LLM`` in a page block: the same engine, in this process."""
    made: list[LLM] = []

    def factory(*args: Any, **kwargs: Any) -> LLM:
        made.append(LLM(*args, **{"in_process": True, **kwargs}))
        return made[-1]

    monkeypatch.setattr(engine.core, "LLM", factory, raising=False)
    return made


def test_the_pages_test_passes(installed: type, in_process_llm: list[LLM],
                               tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="engine.core.worker.step_graph"):
        assert run_page_tests(code_block(PAGE, TEST), "test_gpt2.py",
                              tmp_path=tmp_path) == ["test_greedy_tokens_equal_transformers"]
    [llm] = in_process_llm
    model = llm.llm_engine.core.worker.built.model
    assert type(model) is installed  # the plugin served, not a built-in architecture
    assert type(model.h[0].attn.c_attn).__name__ == "Linear"  # built by ctx.layers
    # Its capture_support says no to the CPU step graph: the line the page shows.
    [line] = [r.message for r in caplog.records if "CPU step graph" in r.message]
    assert line in shown_lines("CPU step graph")


def test_it_refuses_a_context_without_a_layer_factory(installed: type,
                                                     tmp_path: Path) -> None:
    from transformers import AutoConfig

    namespace = exec_block(code_block(PAGE, TEST), filename="test_gpt2.py")
    config = AutoConfig.from_pretrained(namespace["tiny_gpt2"](tmp_path))
    with pytest.raises(ValidationError, match="runs in an engine, on one rank"):
        installed(ModelContext(hf_config=config))


def test_the_rope_settings_example_runs() -> None:
    namespace = exec_block(code_block(PAGE, ROPE), filename="rope_example.py")
    assert namespace["rotary_dim"] == 32


def test_the_moe_example_is_the_test_plugin_packages_model() -> None:
    page = code_block(PAGE, MOE_MODULE).split("\n", 1)[1]  # less its "# src/..." line
    assert page == MOE_PLUGIN.read_text(), (
        f"the page's {MOE_MODULE!r} block and {MOE_PLUGIN} differ: keep them identical")


def test_the_moe_pages_test_passes(installed_moe: type, in_process_llm: list[LLM],
                                   tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="engine.core.worker.step_graph"):
        assert run_page_tests(code_block(PAGE, MOE_TEST), "test_qwen2_moe.py",
                              tmp_path=tmp_path) == ["test_greedy_tokens_equal_transformers"]
    [llm] = in_process_llm
    model = llm.llm_engine.core.worker.built.model
    assert type(model) is installed_moe  # the plugin served: the engine has no Qwen2-MoE
    sparse, dense = model.layers[0].mlp, model.layers[1].mlp
    assert type(sparse).__name__ == "Qwen2MoeSparseMoeBlock" and type(dense).__name__ == \
        "Qwen2MoeMLP"
    assert type(sparse.experts.op).__name__ == "FusedMoE"  # ctx.layers.fused_moe's op
    assert not sparse.experts.op.renormalize  # Qwen1.5-MoE's norm_topk_prob false
    # Its capture_support says no to the CPU step graph: the line the page shows.
    [line] = [r.message for r in caplog.records if "CPU step graph" in r.message]
    assert line in shown_lines("CPU step graph")
    assert "qwen2_moe" in line
