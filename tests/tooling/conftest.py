"""Fixtures for the repository's own tools: a scratch copy of the SDK to break on purpose.

The copy is put in a *just released* state (its own baseline, nothing unreleased), so the
tests read the same whatever version the real SDK is at: ``versions`` names the releases
relative to it.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from sdkapi import deprecations_page  # noqa: E402
from sdkapi.layout import Layout, parse_version  # noqa: E402
from sdkapi.release import ALLOWLIST_HEADER  # noqa: E402
from sdkapi.snapshot import extract  # noqa: E402


@dataclass(frozen=True)
class Versions:
    """The scratch SDK's release and the ones that may follow it."""

    current: str  # e.g. "1.1.0"
    minor: str  # the next minor as notes spell it, e.g. "1.2"
    next_minor: str  # "1.2.0"
    next_patch: str  # "1.1.1"
    next_major: str  # "2.0.0"
    major: int  # 1


@pytest.fixture
def repo(tmp_path: Path) -> Layout:
    """The files the API tools read (SDK sources, baselines, changelog, allowlist, the
    deprecations page) copied under a scratch root and released as they are."""
    sdk = ROOT / "packages" / "plugin-sdk"
    target = tmp_path / "packages" / "plugin-sdk"
    shutil.copytree(sdk / "src", target / "src", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "docs" / "plugins").mkdir(parents=True)
    shutil.copy(ROOT / "docs" / "plugins" / "deprecations.md", tmp_path / "docs" / "plugins")
    layout = Layout(tmp_path)
    version = layout.read_version()
    layout.api_dir.mkdir()
    snapshot = extract(layout.sdk_src, version)
    (layout.api_dir / f"{version}.json").write_text(snapshot.dumps())
    layout.allowlist.write_text(ALLOWLIST_HEADER)
    layout.changelog.write_text(f"# Changelog\n\n## Unreleased\n\n## {version} (2026-01-01)\n\n"
                                f"- Released.\n")
    deprecations_page.write_table(layout.deprecations_page, deprecations_page.render_table(
        snapshot.deprecations(), parse_version(version)[0]))
    return layout


@pytest.fixture
def versions(repo: Layout) -> Versions:
    major, minor, patch = parse_version(repo.read_version())
    return Versions(current=f"{major}.{minor}.{patch}", minor=f"{major}.{minor + 1}",
                    next_minor=f"{major}.{minor + 1}.0", next_patch=f"{major}.{minor}.{patch + 1}",
                    next_major=f"{major + 1}.0.0", major=major)


@pytest.fixture
def edit(repo: Layout) -> Callable[[str, str, str], None]:
    """``edit("attention.py", old, new)``: replace text in an SDK module of the copy."""
    def replace(module: str, old: str, new: str) -> None:
        path = repo.sdk_src / "engine" / "sdk" / module
        text = path.read_text()
        assert old in text, f"{old!r} not in {module}"
        path.write_text(text.replace(old, new, 1))

    return replace
