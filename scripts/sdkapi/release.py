"""Cut an SDK release: ``nox -s release_sdk -- X.Y.Z`` (``python scripts/sdk_api.py release``).

Checks first, writes only when every check passes:

1. ``X.Y.Z`` is newer than the last release, and a proper next step (a patch release
   ``X.Y.(Z+1)``, a minor ``X.(Y+1).0`` or a major ``(X+1).0.0``);
2. the API gate passes for the SDK as ``X.Y.Z`` (breaks, additions, notes, deprecations);
3. the changelog's ``## Unreleased`` section is not empty and names every addition,
   deprecation and accepted break since the last release.

Then it sets ``__version__``, writes the new baseline ``packages/plugin-sdk/api/X.Y.Z.json``,
turns ``## Unreleased`` into ``## X.Y.Z (DATE)``, empties the allowlist (its entries were
breaks against the old baseline) and regenerates the deprecations page. What is left to the
maintainer: review the diff, commit, tag ``engine-plugin-sdk-vX.Y.Z``, publish.
"""

from __future__ import annotations

from sdkapi import changelog, deprecations_page
from sdkapi.gate import GateResult, run_gate
from sdkapi.layout import Layout, parse_version
from sdkapi.snapshot import extract

ALLOWLIST_HEADER = """\
# Accepted breaking changes of the SDK's public API against the last release, one path per
# line, as the gate prints it (`nox -s api_compat`):
#   engine.sdk.some_module.Name  # why the break is acceptable
# A release (`nox -s release_sdk -- X.Y.Z`) empties this file.
"""


def _step_problem(version: tuple[int, int, int], last: tuple[int, int, int]) -> str | None:
    steps = [(last[0], last[1], last[2] + 1), (last[0], last[1] + 1, 0), (last[0] + 1, 0, 0)]
    if version in steps:
        return None
    spelled = ", ".join(".".join(map(str, s)) for s in steps)
    return (f"{'.'.join(map(str, version))} does not follow the last release "
            f"{'.'.join(map(str, last))}: the next release is one of {spelled}")


def release(layout: Layout, version: str, date: str) -> tuple[list[str], list[str]]:
    """Check and write release ``version``; returns ``(problems, what was done)``."""
    try:
        wanted = parse_version(version)
    except ValueError as exc:
        return [str(exc)], []
    released = layout.baselines()
    problems = []
    if released:
        step = _step_problem(wanted, released[-1][0])
        if step:
            return [step], []
    if released:
        result = run_gate(layout, version)
    else:  # the first release: it becomes the first baseline, there is nothing to compare
        result = GateResult(version, None, snapshot=extract(layout.sdk_src, version))
    problems += result.problems
    text = changelog.read(layout.changelog)
    body = changelog.sections(text).get(changelog.UNRELEASED)
    mentionable = [c for c in result.changes if c.kind in ("addition", "deprecation")]
    try:
        allowed = layout.allowlisted()
    except ValueError:
        allowed = {}  # already reported by the gate
    mentionable += [c for c in result.changes if c.kind == "break" and c.path in allowed]
    if body is None:
        problems.append(f"{layout.rel(layout.changelog)} has no '## {changelog.UNRELEASED}' "
                        f"section to release")
    elif not body and not released:
        problems.append(f"{layout.rel(layout.changelog)}: '## {changelog.UNRELEASED}' is empty")
    elif not body and mentionable:
        problems.append(f"{layout.rel(layout.changelog)}: '## {changelog.UNRELEASED}' is "
                        f"empty, but {len(mentionable)} change(s) ship in {version}")
    elif body:
        for change in changelog.unmentioned(body, mentionable):
            problems.append(f"{layout.rel(layout.changelog)}: '## {changelog.UNRELEASED}' does "
                            f"not mention `{changelog.mention_of(change)}` ({change.path}: "
                            f"{change.message})")
    if problems or result.snapshot is None:
        return problems, []
    snapshot = result.snapshot
    layout.write_version(version)
    layout.api_dir.mkdir(parents=True, exist_ok=True)
    baseline = layout.api_dir / f"{version}.json"
    baseline.write_text(snapshot.dumps())
    layout.changelog.write_text(changelog.release_text(text, version, date))
    layout.allowlist.write_text(ALLOWLIST_HEADER)
    deprecations_page.write_table(layout.deprecations_page, deprecations_page.render_table(
        snapshot.deprecations(), wanted[0]))
    done = [f"set __version__ = {version!r} in {layout.rel(layout.version_file)}",
            f"wrote the baseline {layout.rel(baseline)} ({len(snapshot.objects)} public "
            f"objects)",
            f"renamed '## {changelog.UNRELEASED}' to '## {version} ({date})' in "
            f"{layout.rel(layout.changelog)}",
            f"emptied {layout.rel(layout.allowlist)}",
            f"regenerated {layout.rel(layout.deprecations_page)}"]
    return [], done
