"""Kernel choices kept on disk: ``<cache dir>/kernel_choices/<key>.json``.

A record's key is a digest of everything the measurement depends on (the key parts: the
CPU's model and flags, torch's version, the thread count, each candidate kernel with its
distribution's version and a digest of its module's source, the layer's configuration,
the row buckets), so any change measures again, and a record is read only where it was
made for. A record measured on a busy machine says so (``steady``). Writes are atomic (a
concurrent process reads all of a record or none); a record that cannot be read is
measured again and rewritten.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from engine.core.kernel_choice.plan import KernelPlan
from engine.core.machine import cache_dir

logger = logging.getLogger(__name__)

#: The cache directory's subdirectory holding the records.
SUBDIR = "kernel_choices"
#: Bumped when a record's meaning changes; older records are measured again.
FORMAT = 2  # 2: recordable kernels timed replayed from a graph


def choices_dir() -> Path:
    return cache_dir() / SUBDIR


def digest(parts: dict[str, Any]) -> str:
    """The record name for these key parts."""
    text = json.dumps({"format": FORMAT, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


@dataclass(frozen=True)
class StoredChoice:
    """One record: where it is, what it was measured for, the plan, when."""

    path: Path
    key: dict[str, Any]
    plan: KernelPlan
    measured_at: str
    #: Whether its rounds were steady (``KernelPlan.steady``), and how many measurements
    #: of this key it is the last of.
    steady: bool = True
    attempts: int = 1


def load(parts: dict[str, Any]) -> StoredChoice | None:
    """The record for ``parts``, or None (none yet, or unreadable: measure again)."""
    return _read(choices_dir() / f"{digest(parts)}.json")


def save(parts: dict[str, Any], plan: KernelPlan, *, steady: bool = True,
         attempts: int = 1) -> StoredChoice | None:
    """Write the record; None (logged) where the directory is not writable."""
    folder = choices_dir()
    measured_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    record = {"format": FORMAT, "key": parts, "plan": plan.to_json(),
              "measured_at": measured_at, "steady": steady, "attempts": attempts}
    path = folder / f"{digest(parts)}.json"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False) as out:
            json.dump(record, out, indent=1, default=str)
        os.replace(out.name, path)
    except OSError as exc:
        logger.warning("kernel choice not saved in %s (%s): the next start measures again; "
                       "set ENGINE_CACHE_DIR to a writable directory", folder, exc)
        return None
    return StoredChoice(path, parts, plan, measured_at, steady, attempts)


def _read(path: Path) -> StoredChoice | None:
    try:
        record = json.loads(path.read_text())
        if record.get("format") != FORMAT:
            return None
        return StoredChoice(path, dict(record["key"]), KernelPlan.from_json(record["plan"]),
                            str(record.get("measured_at", "")),
                            bool(record.get("steady", True)), int(record.get("attempts", 1)))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        logger.info("kernel choice %s is unreadable (%s); measuring again", path, exc)
        return None


def stored() -> list[StoredChoice]:
    """Every readable record, oldest first."""
    found = [_read(path) for path in sorted(choices_dir().glob("*.json"))]
    return sorted((c for c in found if c is not None), key=lambda c: c.measured_at)


def clear() -> int:
    """Remove every record; the number removed."""
    removed = 0
    for path in choices_dir().glob("*.json"):
        path.unlink(missing_ok=True)
        removed += 1
    return removed
