"""docs/plugins/kv-connectors.md: its connector passes its own test, and serves an engine.

The page's connector block is written to a temporary ``my_plugin/connector.py`` (the
module its test and its entry point name), its test block runs as written, and an engine
selects the connector by ``module:Class``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.core import LLM, SamplingParams
from engine.testing.docs import code_blocks
from engine.testing.engine import assert_kv_pool_full

PAGE = Path(__file__).resolve().parents[3] / "docs" / "plugins" / "kv-connectors.md"


def python_blocks() -> list[str]:
    return code_blocks(PAGE)


@pytest.fixture
def my_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    connector, _ = python_blocks()
    package = tmp_path / "my_plugin"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "connector.py").write_text(connector)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield package
    for name in [m for m in sys.modules if m == "my_plugin" or m.startswith("my_plugin.")]:
        del sys.modules[name]


def test_the_page_has_the_connector_and_its_test() -> None:
    blocks = python_blocks()
    assert len(blocks) == 2
    assert "class PrefixStoreConnector(KVConnector)" in blocks[0]
    assert "check_kv_connector(PrefixStoreConnector)" in blocks[1]


def test_its_test_passes(my_plugin: Path) -> None:
    namespace: dict[str, object] = {}
    exec(compile(python_blocks()[1], str(PAGE), "exec"), namespace)
    namespace["test_prefix_store_conforms"]()  # type: ignore[operator]


def test_it_serves_an_engine(my_plugin: Path, tiny_llama: Path) -> None:
    prompts = [{"prompt_token_ids": list(range(10, 60))}, {"prompt_token_ids": [7] * 20}]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(str(tiny_llama), dtype="float32", in_process=True, plugins="none",
             num_kv_blocks=64, kv_connector="my_plugin.connector:PrefixStoreConnector") as llm:
        first = llm.generate(prompts, params, use_tqdm=False)
        assert llm.llm_engine.core.reset_prefix_cache()
        again = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids
                                                           for o in first]
        assert [o.num_cached_tokens for o in again] == [48, 16]
        assert_kv_pool_full(llm)
