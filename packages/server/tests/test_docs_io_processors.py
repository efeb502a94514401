"""docs/plugins/io-processors.md: its processor, its test and both ways of using it run.

The page's module is written to a temporary ``acme_plugins`` package and selected by
``module:Class``. Its unit test runs as written; its offline example runs with
``engine.core.LLM`` standing in for the tiny test checkpoint; the payload of its ``curl``
example is posted to ``POST /pooling`` of an app serving the processor.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import engine.core
from engine.core import LLM
from engine.core.client.async_llm import AsyncLLM, in_process_client
from engine.core.config import EngineConfig
from engine.server.app import build_app
from engine.testing.docs import code_block, code_blocks, page_package

PAGE = Path(__file__).resolve().parents[3] / "docs" / "plugins" / "io-processors.md"
PROCESSOR = "acme_plugins.sentiment:ReviewSentiment"
FIRST_LINES = ["# src/acme_plugins/sentiment.py", "# offline_sentiment.py",
               "# tests/test_sentiment.py"]


def blocks(language: str = "python") -> list[str]:
    return code_blocks(PAGE, language)


def block(first_line: str) -> str:
    return code_block(PAGE, first_line)


def test_every_python_block_is_run() -> None:
    assert sorted(b.splitlines()[0] for b in blocks()) == sorted(FIRST_LINES)


@pytest.fixture(scope="module")
def acme(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    modules = {"sentiment": block("# src/acme_plugins/sentiment.py")}
    with page_package(tmp_path_factory.mktemp("docs"), "acme_plugins", modules) as root:
        yield root


def test_the_pages_unit_test_passes(acme: Path) -> None:
    namespace: dict[str, Any] = {"__name__": "test_sentiment"}
    exec(compile(block("# tests/test_sentiment.py"), "test_sentiment.py", "exec"), namespace)
    namespace["test_round_trip"]()
    [cases] = [m.args[1] for m in namespace["test_bad_payloads_are_400s"].pytestmark]
    for body in cases:
        namespace["test_bad_payloads_are_400s"](body)


def test_the_offline_example_runs(acme: Path, tiny_llama_checkpoint: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[LLM] = []

    def tiny(*args: Any, **kwargs: Any) -> LLM:
        made.append(LLM(str(tiny_llama_checkpoint), dtype="float32", in_process=True,
                        num_kv_blocks=32, plugins="none", **kwargs))
        return made[-1]

    monkeypatch.setattr(engine.core, "LLM", tiny, raising=False)
    namespace: dict[str, Any] = {"__name__": "offline_sentiment"}
    exec(compile(block("# offline_sentiment.py"), "offline_sentiment.py", "exec"), namespace)
    assert namespace["body"]["labels"][0] in ("positive", "negative", "neutral", "unknown")
    assert made and made[0].llm_engine.io_processor is not None


def _curl_payload() -> Any:
    [bash] = [b for b in blocks("bash") if "/pooling" in b]
    match = re.search(r"-d '(.*?)'", bash, re.DOTALL)
    assert match, bash
    return json.loads(match.group(1))


async def test_the_curl_example_through_post_pooling(acme: Path,
                                                     tiny_llama_checkpoint: Path) -> None:
    config = EngineConfig(model=str(tiny_llama_checkpoint), dtype="float32", num_kv_blocks=32,
                          plugins="none", io_processor=PROCESSOR,
                          plugin_options={PROCESSOR: {"max_review_chars": 20}})
    engine_ = AsyncLLM(config, client=in_process_client, log_stats=False)
    app = build_app(engine_)
    await engine_.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as client:
            response = await client.post("/pooling", json=_curl_payload())
            assert response.status_code == 200, response.text
            labels = response.json()["labels"]
            assert len(labels) == 2 and set(labels) <= {"positive", "negative", "neutral",
                                                        "unknown"}
            too_long = await client.post("/pooling", json={"reviews": ["x" * 21]})
            assert too_long.status_code == 400  # the --plugin-option arrived
            assert too_long.json()["error"]["param"] == "reviews[0]"
    finally:
        await engine_.shutdown()
