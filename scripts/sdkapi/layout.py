"""Where the SDK's files live in the repository, and its version."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_VERSION_LINE = re.compile(r'^__version__ = "([^"]*)"$', re.MULTILINE)
_SEMVER = re.compile(r"^(\d+)\.(\d+)\.(\d+)$")


def parse_version(text: str) -> tuple[int, int, int]:
    """``"1.2.3"`` -> ``(1, 2, 3)``; raises ValueError for anything but MAJOR.MINOR.PATCH."""
    match = _SEMVER.match(text.strip())
    if match is None:
        raise ValueError(f"not a release version: {text!r} (expected MAJOR.MINOR.PATCH, "
                         f"e.g. 1.2.0)")
    major, minor, patch = (int(g) for g in match.groups())
    return major, minor, patch


def minor_of(text: str) -> tuple[int, int]:
    """``"1.2"`` or ``"1.2.3"`` -> ``(1, 2)``: the release a note or deprecation names."""
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


@dataclass(frozen=True)
class Layout:
    """The paths the API tools read and write, under one repository root."""

    root: Path

    @property
    def sdk_src(self) -> Path:
        return self.root / "packages" / "plugin-sdk" / "src"

    @property
    def version_file(self) -> Path:
        return self.sdk_src / "engine" / "sdk" / "_version.py"

    @property
    def api_dir(self) -> Path:
        return self.root / "packages" / "plugin-sdk" / "api"

    @property
    def allowlist(self) -> Path:
        return self.root / "packages" / "plugin-sdk" / "api_compat_allowlist.txt"

    @property
    def changelog(self) -> Path:
        return self.root / "packages" / "plugin-sdk" / "CHANGELOG.md"

    @property
    def deprecations_page(self) -> Path:
        return self.root / "docs" / "plugins" / "deprecations.md"

    def rel(self, path: Path) -> str:
        """``path`` relative to the root, for messages."""
        try:
            return str(path.relative_to(self.root))
        except ValueError:
            return str(path)

    def read_version(self) -> str:
        """``engine.sdk.__version__`` as written in ``_version.py`` (nothing is imported)."""
        match = _VERSION_LINE.search(self.version_file.read_text())
        if match is None:
            raise ValueError(f"{self.rel(self.version_file)} has no line __version__ = \"X.Y.Z\"")
        return match.group(1)

    def write_version(self, version: str) -> None:
        """Replace the ``__version__`` line of ``_version.py``."""
        text = self.version_file.read_text()
        self.version_file.write_text(_VERSION_LINE.sub(f'__version__ = "{version}"', text))

    def baselines(self) -> list[tuple[tuple[int, int, int], Path]]:
        """Released API snapshots, oldest first: ``api/X.Y.Z.json``."""
        found = []
        for path in self.api_dir.glob("*.json"):
            try:
                found.append((parse_version(path.stem), path))
            except ValueError:
                continue
        return sorted(found)

    def allowlisted(self) -> dict[str, str]:
        """Accepted breaks against the current baseline: path -> reason.

        Raises:
            ValueError: an entry has no reason.
        """
        entries: dict[str, str] = {}
        if not self.allowlist.exists():
            return entries
        for number, line in enumerate(self.allowlist.read_text().splitlines(), 1):
            if line.lstrip().startswith("#") or not line.strip():
                continue
            path, _, reason = line.partition("#")
            if not reason.strip():
                raise ValueError(f"{self.rel(self.allowlist)}:{number}: {path.strip()!r} needs "
                                 f"a reason after '#'")
            entries[path.strip()] = reason.strip()
        return entries
