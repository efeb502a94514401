"""Fixtures for the repository's own tools: a scratch copy of the SDK to break on purpose."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from sdkapi.layout import Layout  # noqa: E402


@pytest.fixture
def repo(tmp_path: Path) -> Layout:
    """The files the API tools read (SDK sources, baselines, changelog, allowlist, the
    deprecations page) copied under a scratch root, to edit freely."""
    sdk = ROOT / "packages" / "plugin-sdk"
    target = tmp_path / "packages" / "plugin-sdk"
    shutil.copytree(sdk / "src", target / "src", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(sdk / "api", target / "api")
    for name in ("CHANGELOG.md", "api_compat_allowlist.txt"):
        shutil.copy(sdk / name, target / name)
    (tmp_path / "docs" / "plugins").mkdir(parents=True)
    shutil.copy(ROOT / "docs" / "plugins" / "deprecations.md", tmp_path / "docs" / "plugins")
    return Layout(tmp_path)


@pytest.fixture
def edit(repo: Layout) -> Callable[[str, str, str], None]:
    """``edit("attention.py", old, new)``: replace text in an SDK module of the copy."""
    def replace(module: str, old: str, new: str) -> None:
        path = repo.sdk_src / "engine" / "sdk" / module
        text = path.read_text()
        assert old in text, f"{old!r} not in {module}"
        path.write_text(text.replace(old, new, 1))

    return replace
