"""``nox -s release_sdk -- X.Y.Z``: checks everything first, then writes a consistent release."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sdkapi.gate import run_gate
from sdkapi.layout import Layout
from sdkapi.release import release
from sdkapi.snapshot import Snapshot, extract

ROOT = Path(__file__).resolve().parents[2]
Edit = Callable[[str, str, str], None]
DATE = "2026-12-01"


@pytest.fixture
def next_minor(repo: Layout, edit: Edit, versions: Any) -> str:
    """One addition in the scratch SDK, noted, versioned and in the changelog; returns the
    release that ships it."""
    edit("support.py", "", f'\n\ndef shiny() -> int:\n    """New.\n\n    .. versionadded:: '
         f'{versions.minor}\n    """\n    return 1\n')
    repo.write_version(versions.next_minor)
    repo.changelog.write_text(repo.changelog.read_text().replace(
        "## Unreleased\n", "## Unreleased\n\n### Added\n- `engine.sdk.support.shiny`.\n"))
    return str(versions.next_minor)


def files(repo: Layout) -> dict[str, str]:
    """Every file the release may write, with its content."""
    paths = [repo.version_file, repo.changelog, repo.allowlist, repo.deprecations_page,
             *repo.api_dir.glob("*.json")]
    return {repo.rel(p): p.read_text() for p in paths}


def test_release_writes_version_baseline_changelog_and_resets_the_allowlist(
    repo: Layout, next_minor: str
) -> None:
    repo.allowlist.write_text("# an old header\n")
    problems, done = release(repo, next_minor, DATE)
    assert problems == []
    assert len(done) == 5
    assert repo.read_version() == next_minor
    baseline = Snapshot.load(repo.api_dir / f"{next_minor}.json")
    assert baseline.version == next_minor
    assert baseline.objects == extract(repo.sdk_src, next_minor).objects
    assert "engine.sdk.support.shiny" in baseline.objects
    assert f"## Unreleased\n\n## {next_minor} ({DATE})\n\n### Added\n- `engine.sdk.support." \
           f"shiny`." in repo.changelog.read_text()
    assert repo.allowlist.read_text().startswith("# Accepted breaking changes")
    after = run_gate(repo)  # the tree is now exactly the release
    assert after.ok and after.baseline == next_minor and after.changes == []


def test_release_refuses_a_changelog_that_misses_a_change(
    repo: Layout, next_minor: str
) -> None:
    repo.changelog.write_text(repo.changelog.read_text().replace("`engine.sdk.support.shiny`",
                                                                 "a new helper"))
    before = files(repo)
    problems, done = release(repo, next_minor, DATE)
    assert problems == [
        "packages/plugin-sdk/CHANGELOG.md: '## Unreleased' does not mention `shiny` "
        "(engine.sdk.support.shiny: new function)"]
    assert done == [] and files(repo) == before  # nothing written


def test_release_refuses_an_empty_unreleased_section(repo: Layout, next_minor: str) -> None:
    text = repo.changelog.read_text()
    repo.changelog.write_text(text.replace("### Added\n- `engine.sdk.support.shiny`.\n", ""))
    assert release(repo, next_minor, DATE)[0] == [
        f"packages/plugin-sdk/CHANGELOG.md: '## Unreleased' is empty, but 1 change(s) ship in "
        f"{next_minor}"]


def test_release_refuses_a_version_that_skips_or_goes_back(repo: Layout, versions: Any) -> None:
    major, minor, _ = (int(x) for x in versions.current.split("."))
    steps = f"{versions.next_patch}, {versions.next_minor}, {versions.next_major}"
    assert release(repo, f"{major}.{minor + 2}.0", DATE)[0] == [
        f"{major}.{minor + 2}.0 does not follow the last release {versions.current}: the next "
        f"release is one of {steps}"]
    assert release(repo, versions.current, DATE)[0][0].startswith(
        f"{versions.current} does not follow")
    assert release(repo, "v1.1", DATE)[0] == [
        "not a release version: 'v1.1' (expected MAJOR.MINOR.PATCH, e.g. 1.2.0)"]


def test_release_refuses_additions_in_a_patch_release(
    repo: Layout, next_minor: str, versions: Any
) -> None:
    problems, _ = release(repo, versions.next_patch, DATE)
    assert problems[0].startswith(f"1 addition(s) or deprecation(s) since {versions.current} "
                                  f"need a minor version bump")


def test_release_refuses_a_break(repo: Layout, edit: Edit, next_minor: str) -> None:
    edit("attention.py", "    def describe(self) -> str:", "    def _describe(self) -> str:")
    before = files(repo)
    problems, _ = release(repo, next_minor, DATE)
    assert problems == ["BREAK engine.sdk.attention.AttentionSpec.describe: function removed "
                        "from engine.sdk.attention.AttentionSpec"]
    assert files(repo) == before


def test_release_from_the_command_line(repo: Layout, next_minor: str) -> None:
    command = [sys.executable, str(ROOT / "scripts" / "sdk_api.py"), "--root", str(repo.root),
               "release", next_minor]
    run = subprocess.run([*command, "--date", DATE], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"wrote the baseline packages/plugin-sdk/api/{next_minor}.json" in run.stdout
    assert f"git tag engine-plugin-sdk-v{next_minor}" in run.stdout
    again = subprocess.run(command, capture_output=True, text=True)
    assert again.returncode == 1
    assert f"{next_minor} does not follow the last release {next_minor}" in again.stdout
    assert "nothing was written" in again.stdout
