"""The SDK's API tools: the compatibility gate, releases, snapshots, the deprecations page.

    python scripts/sdk_api.py check                  # nox -s api_compat
    python scripts/sdk_api.py release 1.2.0          # nox -s release_sdk -- 1.2.0
    python scripts/sdk_api.py dump [--ref REF] [--out FILE]
    python scripts/sdk_api.py deprecations [--write]

Every command takes ``--root DIR`` (default: this repository). The rules are in
docs/plugins/versioning.md; the code in scripts/sdkapi/.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

from sdkapi import deprecations_page
from sdkapi.gate import run_gate
from sdkapi.layout import Layout
from sdkapi.release import release
from sdkapi.snapshot import ExtractionError, extract

ROOT = Path(__file__).resolve().parents[1]


def cmd_check(layout: Layout, args: argparse.Namespace) -> int:
    result = run_gate(layout)
    for note in result.notes:
        print(f"note: {note}")
    counts = {kind: len(result.of_kind(kind)) for kind in ("break", "addition", "deprecation")}
    if args.verbose:
        for change in result.changes:
            print(f"{change.kind:<11} {change.path}: {change.message}")
    summary = (f"engine-plugin-sdk {result.version} against the {result.baseline or '(none)'} "
               f"baseline: {counts['break']} break(s), {counts['addition']} addition(s), "
               f"{counts['deprecation']} new deprecation(s)")
    if result.ok:
        print(f"{summary}: OK")
        return 0
    for problem in result.problems:
        print(f"error: {problem}")
    print(f"{summary}: {len(result.problems)} problem(s)")
    return 1


def cmd_release(layout: Layout, args: argparse.Namespace) -> int:
    problems, done = release(layout, args.version, args.date)
    if problems:
        for problem in problems:
            print(f"error: {problem}")
        print(f"engine-plugin-sdk {args.version} was not released; nothing was written.")
        return 1
    for line in done:
        print(line)
    print(f"Next: review `git diff`, then `git commit -am 'engine-plugin-sdk {args.version}'` "
          f"and `git tag engine-plugin-sdk-v{args.version}`.")
    return 0


def _export(ref: str, target: Path) -> Path:
    """The SDK sources of git ``ref``, extracted under ``target``; returns their root."""
    data = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "packages/plugin-sdk/src"],
                          capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(target, filter="data")
    return target


def cmd_dump(layout: Layout, args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        source = Layout(_export(args.ref, Path(tmp))) if args.ref else layout
        snapshot = extract(source.sdk_src, source.read_version())
    if args.out:
        Path(args.out).write_text(snapshot.dumps())
        print(f"wrote {args.out}: engine-plugin-sdk {snapshot.version}, "
              f"{len(snapshot.objects)} public objects")
    else:
        sys.stdout.write(snapshot.dumps())
    return 0


def cmd_deprecations(layout: Layout, args: argparse.Namespace) -> int:
    version = layout.read_version()
    snapshot = extract(layout.sdk_src, version)
    table = deprecations_page.render_table(snapshot.deprecations(), int(version.split(".")[0]))
    if args.write:
        deprecations_page.write_table(layout.deprecations_page, table)
        print(f"wrote {layout.rel(layout.deprecations_page)}")
    else:
        print(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="repository root")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="the API gate (nox -s api_compat)")
    check.add_argument("-v", "--verbose", action="store_true", help="list every change")
    check.set_defaults(run=cmd_check)
    rel = sub.add_parser("release", help="cut a release (nox -s release_sdk -- X.Y.Z)")
    rel.add_argument("version", help="the release, MAJOR.MINOR.PATCH")
    rel.add_argument("--date", default=datetime.date.today().isoformat(),
                     help="release date for the changelog (default: today)")
    rel.set_defaults(run=cmd_release)
    dump = sub.add_parser("dump", help="print or write an API snapshot")
    dump.add_argument("--ref", help="a git ref to snapshot instead of the working tree")
    dump.add_argument("--out", help="write to this file instead of stdout")
    dump.set_defaults(run=cmd_dump)
    deps = sub.add_parser("deprecations", help="print or --write the deprecations table")
    deps.add_argument("--write", action="store_true", help="update docs/plugins/deprecations.md")
    deps.set_defaults(run=cmd_deprecations)
    args = parser.parse_args(argv)
    try:
        return int(args.run(Layout(args.root.resolve()), args))
    except (ExtractionError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
