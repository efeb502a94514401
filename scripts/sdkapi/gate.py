"""The API gate: the working tree's SDK against the released baseline of its major.

What fails (docs/plugins/versioning.md has the rules for plugin authors):

* a breaking change within a major version, unless the allowlist names its path with a
  reason; at a major bump, the removal of anything that was not deprecated in the
  baseline (deprecate for at least one minor release first);
* an addition or a new deprecation without a minor version bump;
* an addition without its ``versionadded`` note, a deprecation without its ``deprecated``
  note (see :mod:`sdkapi.notes`);
* a deprecation past its ``removed_in`` major, or one dated outside the new release;
* an allowlist entry that matches no break (stale entries hide future breaks);
* a docs/plugins/deprecations.md table that differs from the markers in the code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sdkapi import deprecations_page
from sdkapi.compare import Change, compare
from sdkapi.layout import Layout, minor_of, parse_version
from sdkapi.notes import missing_notes
from sdkapi.snapshot import Snapshot, extract


@dataclass
class GateResult:
    """What the gate found; ``ok`` when ``problems`` is empty."""

    version: str
    baseline: str | None
    changes: list[Change] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    snapshot: Snapshot | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def of_kind(self, kind: str) -> list[Change]:
        return [c for c in self.changes if c.kind == kind]


def _version_problems(result: GateResult, base: tuple[int, int, int],
                      current: tuple[int, int, int], layout: Layout) -> None:
    grew = result.of_kind("addition") or result.of_kind("deprecation")
    if grew and current[:2] == base[:2]:
        bump = f"{base[0]}.{base[1] + 1}.0"
        result.problems.append(
            f"{len(grew)} addition(s) or deprecation(s) since {result.baseline} need a minor "
            f"version bump: set __version__ = \"{bump}\" in {layout.rel(layout.version_file)} "
            f"(now {result.version})")


def _break_problems(result: GateResult, allowed: dict[str, str], major_bump: bool,
                    layout: Layout) -> None:
    breaks = result.of_kind("break")
    for path in sorted(set(allowed) - {b.path for b in breaks}):
        result.problems.append(f"{layout.rel(layout.allowlist)}: {path!r} matches no breaking "
                               f"change against {result.baseline}; remove the entry")
    for change in breaks:
        if change.path in allowed:
            result.notes.append(f"allowed break {change.path}: {change.message} "
                                f"(reason: {allowed[change.path]})")
        elif not major_bump:
            result.problems.append(f"BREAK {change.path}: {change.message}")
        elif "removed" in change.message and not change.was_deprecated:
            old_major = (result.baseline or "1").split(".")[0]
            result.problems.append(
                f"BREAK {change.path}: {change.message} without a deprecation period: "
                f"deprecate it in a {old_major}.x release first (it must warn for at least "
                f"one minor release), or allowlist it with a reason")
        else:
            result.notes.append(f"break accepted by the major bump: {change.path}: "
                                f"{change.message}")


def _deprecation_problems(result: GateResult, snapshot: Snapshot,
                          base: tuple[int, int, int], current: tuple[int, int, int]) -> None:
    new_targets = {c.path for c in result.of_kind("deprecation")}
    for dep in snapshot.deprecations():
        since = minor_of(dep["since"])
        removed_major = minor_of(dep["removed_in"])[0]
        if removed_major <= current[0]:
            result.problems.append(
                f"{dep['target']} was to be removed in {dep['removed_in']} and SDK "
                f"{result.version} still has it: remove it, or move removed_in to a later "
                f"major")
        if dep["target"] in new_targets and not base[:2] < since <= current[:2]:
            result.problems.append(
                f"{dep['target']}: a new deprecation must say since=\"{current[0]}."
                f"{current[1]}\" (the release that ships it), not {dep['since']!r}")


def run_gate(layout: Layout, version: str | None = None) -> GateResult:
    """Check the SDK under ``layout`` as ``version`` (default: its ``__version__``)."""
    version = version or layout.read_version()
    current = parse_version(version)
    released = layout.baselines()
    older = [(v, p) for v, p in released if v <= current]
    result = GateResult(version, None)
    if not older:
        result.problems.append(f"no API baseline at or below {version} in "
                               f"{layout.rel(layout.api_dir)}: the gate has nothing to compare")
        return result
    base, base_path = older[-1]
    result.baseline = base_path.stem
    newer = [p.stem for v, p in released if v > current]
    if newer:
        result.problems.append(f"SDK version {version} is older than the released "
                               f"{', '.join(newer)}; versions only go up")
    snapshot = extract(layout.sdk_src, version)
    result.snapshot = snapshot
    result.changes = compare(Snapshot.load(base_path), snapshot)
    try:
        allowed = layout.allowlisted()
    except ValueError as exc:
        result.problems.append(str(exc))
        allowed = {}
    _break_problems(result, allowed, current[0] > base[0], layout)
    _version_problems(result, base, current, layout)
    result.problems += missing_notes(result.changes, snapshot, base, current)
    _deprecation_problems(result, snapshot, base, current)
    table = deprecations_page.render_table(snapshot.deprecations(), current[0])
    if deprecations_page.current_table(layout.deprecations_page) != table:
        result.problems.append(
            f"{layout.rel(layout.deprecations_page)} does not list the deprecations in the "
            f"code: run `python scripts/sdk_api.py deprecations --write` and commit the page")
    return result
