"""Every python block of docs/plugins/*.md is run in CI; this module runs the rest.

:data:`RUN_BY` names, for each page and each python block (by its first line), the test
module that runs it; :data:`NOT_RUN` the blocks deliberately not executed, with why (keep
it short: a block that can run must run). :func:`test_every_python_block_is_run` fails
when a page gains a python block that neither lists: run the block in a test and add it
to :data:`RUN_BY`.

Run here: general-plugins.md (its modules, its test, and the plugin called by a starting
engine) and worker-extensions.md's script (``collective_rpc`` over two tensor-parallel
ranks). Both packages are installed as their pages' ``pyproject.toml`` entry points say,
as a ``.dist-info`` on ``sys.path`` that every engine process discovers.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import engine.core
from engine.core.plugins import _catalog
from engine.testing.docs import (
    PLUGIN_DOCS,
    code_block,
    code_blocks,
    exec_block,
    page_package,
    run_page_tests,
)

ROOT = PLUGIN_DOCS.parents[1]
_TESTS = "packages/engine-core/tests/"

#: page -> first line of each python block -> the test module (from the repository root)
#: that runs it.
RUN_BY: dict[str, dict[str, str]] = {
    "structured-outputs.md": {
        "# offline_choices.py": _TESTS + "test_docs_structured_outputs.py",
        "# offline_structured.py": _TESTS + "test_docs_structured_outputs.py",
        "# src/acme_plugins/choices.py": _TESTS + "test_docs_structured_outputs.py",
        "# tests/test_choices.py": _TESTS + "test_docs_structured_outputs.py",
    },
    "tool-parsers.md": {
        "# src/acme_plugins/brackets.py": "packages/server/tests/test_docs_tool_parsers.py",
        "# tests/test_brackets.py": "packages/server/tests/test_docs_tool_parsers.py",
    },
    "attention-backends.md": {
        "from __future__ import annotations": _TESTS + "test_docs_kernels.py",
        "# src/my_plugin/capped.py": _TESTS + "test_docs_kernels.py",
        "from engine.testing.contracts import DEFAULT_ATTENTION_CASES, check_attention_backend":
            _TESTS + "test_attention_contract.py"},
    "custom-ops.md": {
        "from __future__ import annotations": _TESTS + "test_docs_seams.py",
        "import torch": _TESTS + "test_docs_seams.py",
        "# src/my_plugin/avx512_ops.py": _TESTS + "test_docs_seams.py",
        "# Offline, the same items as a list.": _TESTS + "test_docs_seams.py",
        "# src/my_plugin/cuda_ops.py": _TESTS + "test_docs_seams.py",
        "# checking a fused_moe replacement against the reference": _TESTS + "test_docs_seams.py",
    },
    "endpoints.md": {
        "# src/acme_plugins/readiness.py": "packages/server/tests/test_docs_endpoints.py",
        "# tests/test_readiness.py": "packages/server/tests/test_docs_endpoints.py",
        "# src/acme_plugins/complete.py": "packages/server/tests/test_docs_endpoints.py",
        "# tests/test_complete.py": "packages/server/tests/test_docs_endpoints.py",
    },
    "general-plugins.md": {
        "# src/acme_plugins/config.py": _TESTS + "test_docs_examples.py",
        "# src/acme_plugins/register.py": _TESTS + "test_docs_examples.py",
        "# tests/test_register.py": _TESTS + "test_docs_examples.py",
    },
    "io-processors.md": {
        "# src/acme_plugins/sentiment.py": "packages/server/tests/test_docs_io_processors.py",
        "# offline_sentiment.py": "packages/server/tests/test_docs_io_processors.py",
        "# tests/test_sentiment.py": "packages/server/tests/test_docs_io_processors.py",
    },
    "kv-connectors.md": {
        "from __future__ import annotations": _TESTS + "test_docs_kv_connectors.py",
        "from engine.testing.contracts import check_kv_connector":
            _TESTS + "test_docs_kv_connectors.py",
        "# tests/test_prefix_store_engine.py": _TESTS + "test_docs_kv_connectors.py",
    },
    "step-graph.md": {"# src/my_plugin/c_kernel.py": _TESTS + "test_docs_step_graph.py",
                      "# tests/test_recorded.py": _TESTS + "test_docs_step_graph.py",
                      "# src/my_plugin/scale.py": _TESTS + "test_docs_step_graph.py"},
    "linear-kernels.md": {"from __future__ import annotations": _TESTS + "test_docs_kernels.py",
                          "# src/my_plugin/composed.py": _TESTS + "test_docs_kernels.py"},
    "logits-processors.md": {
        "# my_plugins/processors.py": _TESTS + "test_docs_logits_processors.py",
        "class NoRepeatPerRequest(PerRequestLogitsProcessor):":
            _TESTS + "test_docs_logits_processors.py",
        'outputs = llm.generate(prompts, SamplingParams(max_tokens=64, extra_args={"no_repeat_'
        'window": 4}))': _TESTS + "test_docs_logits_processors.py",
        "# tests/test_no_repeat.py": _TESTS + "test_docs_logits_processors.py",
        "# rows_failed.py": _TESTS + "test_plugin_faults.py",
    },
    "models.md": {
        "# src/acme_plugins/gpt2.py": _TESTS + "test_docs_models.py",
        "# tests/test_gpt2.py": _TESTS + "test_docs_models.py",
        "# rope settings of either transformers era": _TESTS + "test_docs_models.py",
        "# src/acme_plugins/qwen2_moe.py": _TESTS + "test_docs_models.py",
        "# tests/test_qwen2_moe.py": _TESTS + "test_docs_models.py",
    },
    "platforms.md": {
        "# src/acme_plugins/platform.py": _TESTS + "test_docs_seams.py",
        "# tests/test_platform.py": _TESTS + "test_docs_seams.py",
    },
    "quantization.md": {"from __future__ import annotations": _TESTS + "test_docs_kernels.py",
                        "# tests/test_my_int8.py": _TESTS + "test_docs_kernels.py"},
    "schedulers.md": {
        "# src/acme_plugins/policy.py": _TESTS + "test_docs_schedulers.py",
        "# src/acme_plugins/reserving.py": _TESTS + "test_docs_schedulers.py",
        "# tests/test_schedulers.py": _TESTS + "test_docs_schedulers.py",
        "# tests/test_policy.py": _TESTS + "test_docs_schedulers.py",
    },
    "stat-loggers.md": {
        "# src/acme_plugins/statsd.py": _TESTS + "test_docs_seams.py",
        "# tests/test_statsd.py": _TESTS + "test_docs_seams.py",
        "# offline_stats.py": _TESTS + "test_docs_seams.py",
    },
    "testing.md": {
        "# src/acme_plugins/oldest_first.py": "packages/server/tests/test_docs_testing.py",
        "# tests/test_oldest_first.py": "packages/server/tests/test_docs_testing.py",
        "# tests/test_oldest_first_engine.py": "packages/server/tests/test_docs_testing.py",
        "# tests/test_oldest_first_server.py": "packages/server/tests/test_docs_testing.py",
    },
    "versioning.md": {"import warnings": "tests/tooling/test_docs_versioning.py"},
    "worker-extensions.md": {
        "# src/acme_plugins/diagnostics.py": _TESTS + "test_docs_worker_extensions.py",
        "# tests/test_diagnostics.py": _TESTS + "test_docs_worker_extensions.py",
        "from engine.core import LLM": _TESTS + "test_docs_examples.py",
    },
}

#: page -> first line -> why the block is not executed (e.g. a pure signature listing).
NOT_RUN: dict[str, dict[str, str]] = {}


def test_every_python_block_is_run() -> None:
    problems = []
    for path in sorted(PLUGIN_DOCS.glob("*.md")):
        page, text = path.name, path.read_text()
        for fence in sorted(set(re.findall(r"^```(py\w*)\s*$", text, re.MULTILINE)) - {"python"}):
            problems.append(f"{page}: a ```{fence} block: fence python code as ```python")
        first_lines = [block.splitlines()[0] if block.strip() else "" for block in
                       code_blocks(path)]
        listed = {**RUN_BY.get(page, {}), **NOT_RUN.get(page, {})}
        for line, count in sorted(Counter(first_lines).items()):
            if count > 1:
                problems.append(f"{page}: {count} python blocks start with {line!r}: give "
                                f"each a distinct first line (e.g. a '# path/of/file.py' comment)")
            if line not in listed:
                problems.append(f"{page}: the python block starting {line!r} is run by no "
                                f"test: run it in one and list it in RUN_BY "
                                f"({_TESTS}test_docs_examples.py)")
        for line in sorted(set(listed) - set(first_lines)):
            problems.append(f"{page}: RUN_BY/NOT_RUN lists a block starting {line!r} that the "
                            f"page no longer has")
    for page in sorted(set(RUN_BY) | set(NOT_RUN)):
        if not (PLUGIN_DOCS / page).exists():
            problems.append(f"RUN_BY/NOT_RUN name {page}, which docs/plugins does not have")
    assert not problems, "\n".join(problems)


def test_the_listed_test_modules_exist_and_read_their_pages() -> None:
    for page, blocks in RUN_BY.items():
        for module in set(blocks.values()):
            source = (ROOT / module).read_text()
            ast.parse(source)
            assert page in source, f"{module} is listed as running {page} but never names it"


# -- installed as the pages' pyproject.toml says ------------------------------------------

DIST = "acme-engine-plugins"
ENTRY_POINTS = {
    "general-plugins.md": ("engine.general_plugins", "acme_register",
                           "acme_plugins.register:register"),
    "worker-extensions.md": ("engine.worker_extensions", "acme_diagnostics",
                             "acme_plugins.diagnostics:AcmeDiagnostics"),
}


@pytest.fixture(scope="module")
def acme(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The pages' ``acme_plugins`` package, installed (a dist-info) on ``sys.path``."""
    root = tmp_path_factory.mktemp("docs")
    info = root / "acme_engine_plugins-0.3.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST}\nVersion: 0.3.0\n")
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n{name} = {value}\n\n" for group, name, value in ENTRY_POINTS.values()))
    modules = {first_line.rsplit("/", 1)[1].removesuffix(".py"): code_block(page, first_line)
               for page, first_line in [
                   ("general-plugins.md", "# src/acme_plugins/config.py"),
                   ("general-plugins.md", "# src/acme_plugins/register.py"),
                   ("worker-extensions.md", "# src/acme_plugins/diagnostics.py")]}
    with page_package(root, "acme_plugins", modules):
        yield root


@pytest.mark.parametrize("page", sorted(ENTRY_POINTS))
def test_the_entry_point_is_the_one_the_page_registers(page: str) -> None:
    group, name, value = ENTRY_POINTS[page]
    text = (PLUGIN_DOCS / page).read_text()
    assert f'[project.entry-points."{group}"]\n{name} = "{value}"' in text


def test_the_general_plugins_page_test_passes(acme: Path, tmp_path: Path) -> None:
    assert run_page_tests(code_block("general-plugins.md", "# tests/test_register.py"),
                          "test_register.py", tmp_path=tmp_path) == [
        "test_register_is_idempotent_and_effective"]


def test_a_starting_engine_calls_the_general_plugin_once_per_process(
        acme: Path, tiny_llm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from acme_plugins.config import AcmeMLPConfig
    from transformers import AutoConfig

    registered: list[str] = []
    register = AutoConfig.register

    def recording(model_type: str, config: Any, exist_ok: bool = False) -> None:
        registered.append(model_type)
        register(model_type, config, exist_ok=exist_ok)

    monkeypatch.setattr(AutoConfig, "register", recording)
    monkeypatch.setattr(_catalog, "_general_plugins_run", set())  # a fresh process
    for _ in range(2):
        engine.core.LLM("tiny")
    assert registered == [AcmeMLPConfig.model_type]  # the second engine did not call it
    assert "once per process" in " ".join(
        (PLUGIN_DOCS / "general-plugins.md").read_text().split())


# -- worker-extensions.md: the script -----------------------------------------------------


def test_the_worker_extensions_script_runs(acme: Path, tiny_llm: Any,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    exec_block(code_block("worker-extensions.md", "from engine.core import LLM"),
               {"__name__": "__main__"}, "serve_diagnostics.py")
    assert len(tiny_llm.made) == 1
    memory, changed = capsys.readouterr().out.splitlines()
    assert [m["rank"] for m in ast.literal_eval(memory)] == [0, 1]
    assert ast.literal_eval(changed) == [False, False]
