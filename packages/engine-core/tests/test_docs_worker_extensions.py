"""docs/plugins/worker-extensions.md: its extension and its test run as written.

The page's module (``acme_plugins/diagnostics.py``) is written to a temporary package and
selected by ``module:Class``; its unit test runs against it; then it is reached through a
real engine with two tensor-parallel worker processes, as the page shows.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.core import LLM
from engine.core.messages import CollectiveRpcError
from engine.testing.docs import code_block

PAGE = Path(__file__).resolve().parents[3] / "docs" / "plugins" / "worker-extensions.md"


def page_block(first_line: str) -> str:
    """The fenced python block of the page whose first line is ``first_line``."""
    return code_block(PAGE, first_line)


@pytest.fixture(scope="module")
def acme_package(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("docs")
    package = root / "acme_plugins"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "diagnostics.py").write_text(page_block("# src/acme_plugins/diagnostics.py"))
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))
    for name in [m for m in sys.modules if m.startswith("acme_plugins")]:
        del sys.modules[name]


def test_the_pages_unit_test_passes(acme_package: Path) -> None:
    namespace: dict[str, object] = {}
    exec(compile(page_block("# tests/test_diagnostics.py"), "test_diagnostics.py", "exec"),
         namespace)
    namespace["test_fingerprint_and_memory"]()  # type: ignore[operator]


def test_the_extension_is_reached_on_every_rank(acme_package: Path, tiny_llama: Path) -> None:
    with LLM(str(tiny_llama), dtype="float32", num_kv_blocks=32, plugins="none",
             in_process=True, tensor_parallel_size=2,
             worker_extensions=["acme_plugins.diagnostics:AcmeDiagnostics"]) as llm:
        memory = llm.collective_rpc("acme_memory")
        assert [m["rank"] for m in memory] == [0, 1]
        assert all(m["parameter_bytes"] > 0 and m["kv_cache_bytes"] > 0 for m in memory)
        assert llm.collective_rpc("acme_weights_changed", timeout=10) == [False, False]
        fingerprints = llm.collective_rpc("acme_fingerprint")
        assert fingerprints[0]["sha256"] != fingerprints[1]["sha256"]  # different shards
        with pytest.raises(CollectiveRpcError, match=r"^collective_rpc 'acme_memroy': no "
                           r"worker extension defines 'acme_memroy'; callable methods: "
                           r"acme_fingerprint \(.*\), acme_memory"):
            llm.collective_rpc("acme_memroy")
