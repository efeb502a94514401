"""The fenced code blocks of the docs/plugins pages, for tests that run a page's examples."""

from __future__ import annotations

import re
from pathlib import Path

#: docs/plugins in a source checkout.
PLUGIN_DOCS = Path(__file__).resolve().parents[5] / "docs" / "plugins"


def code_blocks(page: str | Path, language: str = "python") -> list[str]:
    """Every ```language block of ``page`` (a docs/plugins file name, or a path), in order."""
    path = PLUGIN_DOCS / page if isinstance(page, str) else page
    return [str(b) for b in re.findall(rf"```{language}\n(.*?)```", path.read_text(), re.DOTALL)]


def code_block(page: str | Path, first_line: str, language: str = "python") -> str:
    """The block of ``page`` whose first line is ``first_line``.

    Raises:
        AssertionError: the page has no such block.
    """
    for text in code_blocks(page, language):
        if text.splitlines()[0] == first_line:
            return text
    name = page if isinstance(page, str) else page.name
    raise AssertionError(f"{name} has no {language} block starting with {first_line!r}")
