"""Every addition carries a ``versionadded`` note; every deprecation a ``deprecated`` note.

Where the note goes (Sphinx directives, in Google-style docstrings):

* a new module, class, function or method: ``.. versionadded:: X.Y`` in its own docstring;
* a new attribute, dataclass field, enum member or parameter of an existing object (things
  without a docstring of their own): ``.. versionchanged:: X.Y`` (or ``versionadded``) in
  the owner's docstring, naming it, e.g. ``.. versionchanged:: 1.2 Added ``priority``.``
  (an attribute docstring with ``.. versionadded:: X.Y`` works too);
* a deprecated function, class, method or hook: ``.. deprecated:: X.Y`` in its docstring.

``X.Y`` is the release that first ships the change: newer than the baseline, at most the
current version.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from sdkapi.compare import Change
from sdkapi.layout import minor_of
from sdkapi.snapshot import Snapshot

Version = tuple[int, int, int]


def _in_range(note_version: str, baseline: Version, current: Version) -> bool:
    return baseline[:2] < minor_of(note_version) <= current[:2]


def _has(record: dict[str, Any] | None, directives: tuple[str, ...], baseline: Version,
         current: Version, name: str | None = None) -> bool:
    for directive, version, text in (record or {}).get("notes", []):
        if directive not in directives or not _in_range(version, baseline, current):
            continue
        if name is None or re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", text):
            return True
    return False


def missing_notes(
    changes: Iterable[Change], new: Snapshot, baseline: Version, current: Version
) -> list[str]:
    """One message per addition or deprecation whose note is missing."""
    want = f"{current[0]}.{current[1]}"
    problems = []
    for change in changes:
        if change.kind == "addition" and change.needs_note:
            record = new.objects.get(change.path)
            if change.owner is None or (record and record["kind"] in ("class", "function")):
                if not _has(record, ("versionadded",), baseline, current):
                    problems.append(f"{change.path}: {change.message}; add "
                                    f"`.. versionadded:: {want}` to its docstring")
            elif not (_has(record, ("versionadded",), baseline, current) or _has(
                    new.objects.get(change.owner), ("versionchanged", "versionadded"),
                    baseline, current, change.name)):
                problems.append(f"{change.path}: {change.message}; add `.. versionchanged:: "
                                f"{want} Added ``{change.name}``.` to the docstring of "
                                f"{change.owner}")
        elif change.kind == "deprecation":
            record = new.objects.get(change.path)
            if record is None or record["kind"] == "alias":
                continue  # arguments and module names: the owner documents them
            since = record["deprecated"]["since"]
            if not any(d == "deprecated" and minor_of(v) == minor_of(since)
                       for d, v, _ in record.get("notes", [])):
                problems.append(f"{change.path}: deprecated since {since}; add "
                                f"`.. deprecated:: {since} <what to use instead>` to its "
                                f"docstring")
    return problems
