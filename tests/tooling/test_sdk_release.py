"""``nox -s release_sdk -- X.Y.Z``: checks everything first, then writes a consistent release."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from sdkapi.gate import run_gate
from sdkapi.layout import Layout
from sdkapi.release import release
from sdkapi.snapshot import Snapshot, extract

ROOT = Path(__file__).resolve().parents[2]
Edit = Callable[[str, str, str], None]


def files(repo: Layout) -> dict[str, str]:
    """Every file the release may write, with its content."""
    paths = [repo.version_file, repo.changelog, repo.allowlist, repo.deprecations_page,
             *repo.api_dir.glob("*.json")]
    return {repo.rel(p): p.read_text() for p in paths}


def test_release_writes_version_baseline_changelog_and_resets_the_allowlist(
    repo: Layout,
) -> None:
    repo.allowlist.write_text("# stale header only\n")
    problems, done = release(repo, "1.1.0", "2026-12-01")
    assert problems == []
    assert len(done) == 5
    assert repo.read_version() == "1.1.0"
    baseline = Snapshot.load(repo.api_dir / "1.1.0.json")
    assert baseline.version == "1.1.0"
    assert baseline.objects == extract(repo.sdk_src, "1.1.0").objects
    changelog = repo.changelog.read_text()
    assert "## Unreleased\n\n## 1.1.0 (2026-12-01)\n\n### Added\n- `engine.sdk.deprecation`" \
        in changelog
    assert repo.allowlist.read_text().startswith("# Accepted breaking changes")
    after = run_gate(repo)  # the tree is now exactly the release
    assert after.ok and after.baseline == "1.1.0" and after.changes == []


def test_release_refuses_a_changelog_that_misses_a_change(repo: Layout) -> None:
    repo.changelog.write_text(repo.changelog.read_text().replace("`registered`, ", ""))
    before = files(repo)
    problems, done = release(repo, "1.1.0", "2026-12-01")
    assert problems == [
        "packages/plugin-sdk/CHANGELOG.md: '## Unreleased' does not mention `registered` "
        "(engine.sdk.deprecation.registered: new function)"]
    assert done == [] and files(repo) == before  # nothing written


def test_release_refuses_an_empty_unreleased_section(repo: Layout) -> None:
    text = repo.changelog.read_text()
    start, end = text.index("### Added"), text.index("## 1.0.0")
    repo.changelog.write_text(text[:start] + text[end:])
    [problem] = release(repo, "1.1.0", "2026-12-01")[0]
    assert problem.startswith("packages/plugin-sdk/CHANGELOG.md: '## Unreleased' is empty, but "
                              "14 change(s) ship in 1.1.0")


def test_release_refuses_a_version_that_skips_or_goes_back(repo: Layout) -> None:
    assert release(repo, "1.3.0", "2026-12-01")[0] == [
        "1.3.0 does not follow the last release 1.0.0: the next release is one of 1.0.1, "
        "1.1.0, 2.0.0"]
    assert release(repo, "1.0.0", "2026-12-01")[0][0].startswith("1.0.0 does not follow")
    assert release(repo, "v1.1", "2026-12-01")[0] == [
        "not a release version: 'v1.1' (expected MAJOR.MINOR.PATCH, e.g. 1.2.0)"]


def test_release_refuses_additions_in_a_patch_release(repo: Layout) -> None:
    problems, _ = release(repo, "1.0.1", "2026-12-01")
    assert problems[0].startswith("14 addition(s) or deprecation(s) since 1.0.0 need a minor "
                                  "version bump")


def test_release_refuses_a_break(repo: Layout, edit: Edit) -> None:
    edit("attention.py", "    def describe(self) -> str:", "    def _describe(self) -> str:")
    before = files(repo)
    problems, _ = release(repo, "1.1.0", "2026-12-01")
    assert problems == ["BREAK engine.sdk.attention.AttentionSpec.describe: function removed "
                        "from engine.sdk.attention.AttentionSpec"]
    assert files(repo) == before


def test_release_from_the_command_line(repo: Layout) -> None:
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "sdk_api.py"), "--root",
                          str(repo.root), "release", "1.1.0", "--date", "2026-12-01"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "wrote baseline packages/plugin-sdk/api/1.1.0.json" in run.stdout
    assert "git tag engine-plugin-sdk-v1.1.0" in run.stdout
    again = subprocess.run([sys.executable, str(ROOT / "scripts" / "sdk_api.py"), "--root",
                            str(repo.root), "release", "1.1.0"], capture_output=True, text=True)
    assert again.returncode == 1
    assert "1.1.0 does not follow the last release 1.1.0" in again.stdout
    assert "nothing was written" in again.stdout
