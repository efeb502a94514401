"""docs/plugins/deprecations.md: the table of deprecations, generated from the SDK's markers.

The table sits between two marker comments; the rest of the page is written by hand.
``python scripts/sdk_api.py deprecations --write`` regenerates it, and the API gate fails
when the committed page and the code disagree.
"""

from __future__ import annotations

from pathlib import Path

from sdkapi.layout import minor_of

BEGIN = ("<!-- BEGIN generated: `python scripts/sdk_api.py deprecations --write` writes this "
         "table from the SDK's deprecation markers; do not edit it by hand -->")
END = "<!-- END generated -->"


def render_table(deprecations: list[dict[str, str]], major: int) -> str:
    """The generated block, markers included: newest first."""
    lines = [BEGIN, "", "| deprecated in | what | replacement | removed in |",
             "|---|---|---|---|"]
    for dep in sorted(deprecations,
                      key=lambda d: (tuple(-x for x in minor_of(d["since"])), d["target"])):
        lines.append(f"| {dep['since']} | `{dep['target']}` ({dep['kind']}) | "
                     f"{dep['replacement']} | {dep['removed_in']} |")
    if not deprecations:
        lines += ["", f"No deprecations in {major}.x yet."]
    return "\n".join([*lines, "", END])


def current_table(page: Path) -> str | None:
    """The generated block as committed, or None when the markers are missing."""
    text = page.read_text()
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        return None
    return text[start:end + len(END)]


def write_table(page: Path, table: str) -> None:
    """Replace the generated block of ``page`` with ``table``.

    Raises:
        ValueError: the page lacks the markers.
    """
    old = current_table(page)
    if old is None:
        raise ValueError(f"{page} has no generated block ({BEGIN!r} ... {END!r})")
    page.write_text(page.read_text().replace(old, table))
