"""docs/serving.md's Python example (``AsyncLLM`` without HTTP) runs as written."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

from engine.testing.docs import code_block

SERVING = Path(__file__).resolve().parents[3] / "docs" / "serving.md"


def test_async_llm_example_runs_as_written(tmp_path: Path) -> None:
    script = tmp_path / "async_generate.py"
    script.write_text(code_block(SERVING, "# async_generate.py"))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert lines, "the example printed nothing"
    # Cumulative text: every line extends the one before it.
    assert all(b.startswith(a) for a, b in itertools.pairwise(lines)), lines
