"""Compare the SDK's public API with its last release and fail on unannounced breaks.

    python scripts/api_compat.py [--against REF]

``REF`` defaults to the newest git tag ``engine-plugin-sdk-v*``. A breaking change (griffe's
``find_breaking_changes``: removed names, changed signatures, ...) passes only when the SDK's
major version went up, or when ``packages/plugin-sdk/api_compat_allowlist.txt`` lists the
object path with a reason (``path  # reason``). Exit status 1 on any other break.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import griffe

ROOT = Path(__file__).resolve().parents[1]
SDK_SRC = ROOT / "packages" / "plugin-sdk" / "src"
ALLOWLIST = ROOT / "packages" / "plugin-sdk" / "api_compat_allowlist.txt"
TAG_PREFIX = "engine-plugin-sdk-v"


def last_release_tag() -> str | None:
    """The newest ``engine-plugin-sdk-v*`` tag, or None."""
    tags = subprocess.run(["git", "tag", "--list", f"{TAG_PREFIX}*", "--sort=-v:refname"],
                          cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return tags[0] if tags else None


def allowlisted() -> dict[str, str]:
    """Accepted breaks: object path -> reason."""
    entries = {}
    if ALLOWLIST.exists():
        for line in ALLOWLIST.read_text().splitlines():
            path, _, reason = line.partition("#")
            if path.strip():
                if not reason.strip():
                    raise SystemExit(f"{ALLOWLIST}: {path.strip()!r} needs a reason after '#'")
                entries[path.strip()] = reason.strip()
    return entries


def main() -> int:
    """Run the comparison; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--against", default=None, help="git ref of the last release")
    args = parser.parse_args()
    ref = args.against or last_release_tag()
    if ref is None:
        print(f"No SDK release tagged yet (git tag {TAG_PREFIX}X.Y.Z): nothing to compare.")
        return 0
    old = griffe.load_git("engine.sdk", ref=ref, repo=ROOT,
                          search_paths=["packages/plugin-sdk/src"])
    new = griffe.load("engine.sdk", search_paths=[str(SDK_SRC)])
    old_major = int(str(old["_version"].members["__version__"].value).strip("'\"").split(".")[0])
    sys.path.insert(0, str(SDK_SRC))
    from engine.sdk._version import SDK_MAJOR

    allowed = allowlisted()
    breaks = [b for b in griffe.find_breaking_changes(old, new) if b.obj.path not in allowed]
    for breakage in breaks:
        print(f"BREAK {breakage.explain()}")
    if breaks and SDK_MAJOR == old_major:
        print(f"{len(breaks)} breaking change(s) against {ref} without a major version bump "
              f"(SDK {SDK_MAJOR}.x). Bump the major version, or list each path in "
              f"{ALLOWLIST.relative_to(ROOT)} with a reason.")
        return 1
    print(f"SDK API compatible with {ref}" + (" (major bump)" if breaks else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
