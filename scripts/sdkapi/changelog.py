"""packages/plugin-sdk/CHANGELOG.md: sections per release, and what a release must mention.

The file has one ``## VERSION (DATE)`` section per release, newest first, and an
``## Unreleased`` section on top collecting what the next release ships. A release turns
``Unreleased`` into its own section and checks that every addition, deprecation and accepted
break since the last release is mentioned (by its name, in backticks).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from sdkapi.compare import Change

UNRELEASED = "Unreleased"
_HEADING = re.compile(r"^## +(\S+)[^\n]*$", re.MULTILINE)


def sections(text: str) -> dict[str, str]:
    """Heading word (``Unreleased``, ``1.2.0``) -> the section's body."""
    matches = list(_HEADING.finditer(text))
    found = {}
    for i, match in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        found[match.group(1)] = text[match.end():end].strip()
    return found


def mention_of(change: Change) -> str:
    """The name a changelog entry must mention for ``change``."""
    if change.name:
        return change.name
    path = change.path.split("(")[0]
    return path.rsplit(".", 1)[-1]


def unmentioned(body: str, changes: Iterable[Change]) -> list[Change]:
    """The changes whose name does not appear in ``body`` in backticks."""
    missing = []
    for change in changes:
        name = mention_of(change)
        if not re.search(rf"`[^`]*(?<![\w]){re.escape(name)}(?!\w)[^`]*`", body):
            missing.append(change)
    return missing


def release_text(text: str, version: str, date: str) -> str:
    """``text`` with ``## Unreleased`` renamed to this release and a fresh one above it."""
    match = re.search(rf"^## +{UNRELEASED}\b[^\n]*$", text, re.MULTILINE)
    if match is None:
        raise ValueError(f"no '## {UNRELEASED}' section")
    return (text[:match.start()] + f"## {UNRELEASED}\n\n## {version} ({date})"
            + text[match.end():])


def read(path: Path) -> str:
    """The changelog's text ('' when missing)."""
    return path.read_text() if path.exists() else ""
