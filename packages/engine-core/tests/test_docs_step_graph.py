"""docs/plugins/step-graph.md: the C kernel recorded in the CPU step graph, as written.

The page's C source and ``c_kernel`` module become ``my_plugin``; the page's test block
passes as written, and the kernel, installed as an entry point and forced with
``--linear-kernel c_matmul``, is recorded beside the engine's kernels and gives the tokens
of the same kernel run eagerly.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.core import LLM
from engine.kernels.cpu.native import native_kernels
from engine.sdk import SamplingParams
from engine.sdk.groups import LINEAR_KERNELS
from engine.testing.docs import code_block, page_package, run_page_tests
from engine.testing.engine import assert_kv_pool_full
from engine.testing.test_plugins import entry_installer

PAGE = "step-graph.md"
NATIVE = native_kernels()
pytestmark = pytest.mark.skipif(NATIVE is None, reason="the engine's CPU kernels (and so its "
                                "step graph) cannot be built here")
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [list(range(3, 30)), [7, 7, 8, 9], list(range(200, 205)) * 3]


@pytest.fixture(scope="module")
def my_plugin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    modules = {"c_kernel": code_block(PAGE, "# src/my_plugin/c_kernel.py")}
    with page_package(tmp_path_factory.mktemp("docs"), "my_plugin", modules) as root:
        (root / "my_plugin" / "matmul.c").write_text(code_block(PAGE, "#include <stdint.h>",
                                                                language="c"))
        yield root


def generate(path: Path, **kwargs: Any) -> tuple[list[list[int]], Any]:
    options: dict[str, Any] = {"dtype": "float32", "in_process": True, "num_kv_blocks": 32,
                               "linear_kernel": "c_matmul"}
    with LLM(str(path), **{**options, **kwargs}) as llm:
        graph = llm.llm_engine.core.worker.model_runner.step_graph
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                               use_tqdm=False)
        assert_kv_pool_full(llm)
    return [list(o.outputs[0].token_ids) for o in outputs], graph


def test_the_pages_test_passes_as_written(my_plugin: Path) -> None:
    assert run_page_tests(code_block(PAGE, "# tests/test_recorded.py")) == [
        "test_apply_is_one_recorded_call"]


def test_the_c_kernel_is_recorded_beside_the_engines_kernels(
        my_plugin: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from my_plugin.c_kernel import CMatmulKernel

    entry_installer(monkeypatch, "my-engine-plugins", "0.1")(LINEAR_KERNELS, "c_matmul",
                                                             CMatmulKernel)
    eager, none = generate(tiny_llama, enforce_eager=True)
    assert none is None
    tokens, graph = generate(tiny_llama)
    assert graph is not None
    names = Counter(graph.graph.names)
    assert names["my_plugin.matmul"] >= 7 and names["paged_attention"] >= 1
    assert tokens == eager


def test_the_cpp_entry_builds_and_runs_as_written(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``engine.sdk.native`` section: its C++ entry and Python lines, as written."""
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    modules = {"scale": code_block(PAGE, "# src/my_plugin/scale.py")}
    with page_package(tmp_path, "my_plugin_cpp", modules) as root:
        (root / "my_plugin_cpp" / "scale.cpp").write_text(
            code_block(PAGE, "// src/my_plugin/scale.cpp: rows [rows, width] float32, "
                             "contiguous, times factor in place.", language="cpp"))
        import my_plugin_cpp.scale  # noqa: F401 - its asserts run on import
    assert len(list((tmp_path / "cache" / "native").glob("my_plugin_scale-*.so"))) == 1
