"""docs/plugins/logits-processors.md: ``no_repeat`` passes the page's suite and serves.

The page's module is its first two blocks (``NoRepeat``, then ``NoRepeatPerRequest``
below it), written to a temporary ``my_plugins/processors.py``. The page's conformance
test runs as written; the "Passing parameters" snippet runs against an engine on the tiny
test checkpoint with the processor loaded (``LLM(model, logits_processors=[NoRepeat])``),
and its outputs never repeat a token inside the window, while a request without the
parameter is served unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.core import LLM
from engine.sdk import SamplingParams
from engine.testing.docs import code_block, exec_block, run_page_tests

PAGE = "logits-processors.md"
MODULE = "# my_plugins/processors.py"
PER_REQUEST = "class NoRepeatPerRequest(PerRequestLogitsProcessor):"
SNIPPET = ("outputs = llm.generate(prompts, SamplingParams(max_tokens=64, "
           'extra_args={"no_repeat_window": 4}))')
TEST = "# tests/test_no_repeat.py"


@pytest.fixture(scope="module")
def my_plugins(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("docs")
    package = root / "my_plugins"
    package.mkdir()
    (package / "__init__.py").write_text("")
    source = code_block(PAGE, MODULE) + "\n\n" + code_block(PAGE, PER_REQUEST)
    (package / "processors.py").write_text(source)
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))
    for name in [m for m in sys.modules if m.startswith("my_plugins")]:
        del sys.modules[name]


def test_the_pages_conformance_test_passes(my_plugins: Path) -> None:
    ran = run_page_tests(code_block(PAGE, TEST), "test_no_repeat.py")
    assert ran == ["test_conformance"] * 4 + ["test_rejects_a_bad_window"]


def repeats(token_ids: list[int], window: int) -> list[int]:
    """Positions whose token is one of the ``window`` tokens generated before it."""
    return [i for i, t in enumerate(token_ids) if t in token_ids[max(0, i - window):i]]


@pytest.mark.parametrize("processor", ["NoRepeat", "NoRepeatPerRequest"])
def test_the_parameter_snippet_runs_in_an_engine(my_plugins: Path, tiny_llama: Path,
                                                 processor: str) -> None:
    import my_plugins.processors as module

    cls = getattr(module, processor)
    prompts = ["Once upon a time", "abab abab abab"]
    plain = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    with LLM(str(tiny_llama), dtype="float32", in_process=True, num_kv_blocks=64,
             plugins="none", logits_processors=[cls]) as llm:
        baseline = [o.outputs[0].token_ids for o in llm.generate(prompts, plain,
                                                                 use_tqdm=False)]
        namespace: dict[str, Any] = {"llm": llm, "prompts": prompts,
                                     "SamplingParams": SamplingParams}
        exec_block(code_block(PAGE, SNIPPET), namespace)
        again = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    outputs = namespace["outputs"]
    assert all(o.outputs[0].token_ids for o in outputs)
    assert all(repeats(list(o.outputs[0].token_ids), 4) == [] for o in outputs)
    assert any(repeats(list(ids), 4) for ids in baseline)  # the ban is what made the difference
    assert again == baseline  # requests without the parameter are untouched
