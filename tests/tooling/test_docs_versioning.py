"""docs/plugins/versioning.md and deprecations.md: their examples run and match the code."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from sdkapi.gate import run_gate
from sdkapi.layout import Layout

from engine.sdk.deprecation import Deprecation

DOCS = Path(__file__).resolve().parents[2] / "docs" / "plugins"
Edit = Callable[[str, str, str], None]


def python_blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), re.DOTALL)


def test_python_examples_run() -> None:
    page = "versioning.md"
    assert python_blocks(page)
    for block in python_blocks(page):
        run = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True)
        assert run.returncode == 0, f"{page} example failed:\n{block}\n{run.stderr}"


def test_the_gate_output_shown_is_what_the_gate_prints(repo: Layout, edit: Edit) -> None:
    edit("stat_logger.py", "iteration_stats: IterationStats | None\n    ) -> None:",
         "iteration_stats: IterationStats | None,\n        verbose: bool = False,\n    ) -> None:")
    [problem] = run_gate(repo).problems
    assert f"error: {problem}\n" in (DOCS / "versioning.md").read_text()


def test_the_warning_shown_is_what_the_sdk_emits() -> None:
    dep = Deprecation("engine.sdk.logits_processor.LogitsProcessor.old_hook", "hook", "1.3",
                      "new_hook", "2.0")
    shown = ("plugin 'my_proc' (group engine.logits_processors, distribution acme-plugins "
             f"0.3.0): {dep.message()}\n")
    assert shown in (DOCS / "deprecations.md").read_text()
    check = DOCS / "versioning.md"
    stat = Deprecation("engine.sdk.stat_logger.StatLogger.log", "hook", "1.3", "record", "2.0")
    assert f"        deprecated: {stat.message()}\n" in check.read_text()
