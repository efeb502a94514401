"""docs/plugins/kv-connectors.md: its connector passes its own test, and serves an engine.

The page's connector block is written to a temporary ``my_plugin/connector.py`` (the
module its tests and its entry point name), and its two test blocks run as written: the
contract suite, and an engine that selects the connector by ``module:Class``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.testing.docs import code_blocks, run_page_tests

PAGE = Path(__file__).resolve().parents[3] / "docs" / "plugins" / "kv-connectors.md"


def python_blocks() -> list[str]:
    return code_blocks(PAGE)


@pytest.fixture
def my_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    connector = python_blocks()[0]
    package = tmp_path / "my_plugin"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "connector.py").write_text(connector)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield package
    for name in [m for m in sys.modules if m == "my_plugin" or m.startswith("my_plugin.")]:
        del sys.modules[name]


def test_the_page_has_the_connector_and_its_tests() -> None:
    blocks = python_blocks()
    assert len(blocks) == 3
    assert "class PrefixStoreConnector(KVConnector)" in blocks[0]
    assert "check_kv_connector(PrefixStoreConnector)" in blocks[1]
    assert blocks[2].startswith("# tests/test_prefix_store_engine.py")


def test_its_test_passes(my_plugin: Path) -> None:
    assert run_page_tests(python_blocks()[1]) == ["test_prefix_store_conforms"]


def test_it_serves_an_engine(my_plugin: Path, tiny_llama: Path) -> None:
    assert run_page_tests(python_blocks()[2], tiny_llama_checkpoint=tiny_llama) == [
        "test_prefix_store_serves_an_engine"]
