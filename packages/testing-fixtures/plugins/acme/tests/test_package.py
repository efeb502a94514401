"""The installed distribution: one entry per extension point, all valid by `engine plugins
check`, and its rms_norm shown as a candidate beside the engine's own."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys

from engine.sdk import check_contract_version
from engine.sdk.groups import GROUPS

DIST = "acme-engine-plugins"


def engine_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``engine ARGS`` (the CLI engine-server installs) in a subprocess."""
    return subprocess.run([sys.executable, "-m", "engine.server.cli", *args],
                          capture_output=True, text=True, timeout=300)


def test_one_entry_per_extension_point_each_built_for_sdk_1() -> None:
    entries = importlib.metadata.distribution(DIST).entry_points
    assert sorted({e.group for e in entries}) == sorted(GROUPS)
    for entry in entries:
        obj = entry.load()
        if isinstance(obj, type) and GROUPS[entry.group].kind == "class":
            assert check_contract_version(obj), entry
    from packaging.requirements import Requirement  # pytest's own dependency

    [sdk] = [r for r in map(Requirement, importlib.metadata.requires(DIST) or [])
             if r.name == "engine-plugin-sdk"]
    assert str(sdk.specifier) in ("<2,>=1.1", ">=1.1,<2")  # both bounds: versioning.md


def test_engine_plugins_check_passes() -> None:
    result = engine_cli("plugins", "check", DIST)
    assert result.returncode == 0, result.stdout + result.stderr
    entries = importlib.metadata.distribution(DIST).entry_points
    assert f"{len(entries)} ok, 0 failed" in result.stdout


def test_rms_norm_is_a_candidate_beside_the_engines_own() -> None:
    result = engine_cli("plugins", "list", "--json")
    assert result.returncode == 0, result.stderr
    rows = [r for r in json.loads(result.stdout)
            if r["group"] == "engine.custom_ops" and r["name"] == "rms_norm"]
    by_dist = {r["distribution"]: r for r in rows}
    assert {DIST, "engine-core", "engine-kernels"} <= set(by_dist)
    assert by_dist[DIST]["used"] is True  # on this CPU: ours, by the default rule
    assert not any(r["conflicts"] for r in rows)
