"""``engine plugins list|check`` and ``engine --version`` as a user runs them."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest

from engine.sdk import __version__ as SDK_VERSION
from engine.testing.test_plugins import run_engine_cli


def test_version(test_plugins_dir: Path) -> None:
    result = run_engine_cli(["--version"], test_plugins_dir)
    assert result.returncode == 0
    assert "engine 0.1.0" in result.stdout and f"engine-plugin-sdk {SDK_VERSION}" in result.stdout


def test_list_json_shows_test_plugins_with_distributions(test_plugins_dir: Path) -> None:
    result = run_engine_cli(["plugins", "list", "--json"], test_plugins_dir)
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    by_name = {(r["group"], r["name"], r["distribution"]): r for r in rows}
    good = by_name[("engine.logits_processors", "test_good_ban_token", "engine-test-plugin-good")]
    assert good["version"] == "0.1.0" and good["allowed"] is True
    assert good["processes"] == ["frontend", "worker"]
    echo = by_name[("engine.endpoints", "test_good_echo", "engine-test-plugin-good")]
    assert echo["allowed"] is False and "opt-in" in echo["reason"]
    dup = by_name[("engine.scheduling_policies", "test_dup_policy", "engine-test-plugin-dup-a")]
    assert dup["conflicts"] == ["engine-test-plugin-dup-b 0.1.0"]


def test_list_text_shows_conflicts(test_plugins_dir: Path) -> None:
    result = run_engine_cli(["plugins", "list"], test_plugins_dir)
    assert result.returncode == 0, result.stderr
    assert ("CONFLICT with engine-test-plugin-dup-b 0.1.0: an error if this name is used; "
            "select one by its class path (module:Class)") in result.stdout
    assert "engine.logits_processors  (loaded in: frontend, worker)" in result.stdout


def test_empty_allowlist_fails_mentioning_none(test_plugins_dir: Path) -> None:
    result = run_engine_cli(["plugins", "list"], test_plugins_dir, {"ENGINE_PLUGINS": ""})
    assert result.returncode == 2
    assert "ENGINE_PLUGINS=none" in result.stderr


def test_none_loads_nothing(test_plugins_dir: Path) -> None:
    result = run_engine_cli(["plugins", "list", "--json"], test_plugins_dir,
                            {"ENGINE_PLUGINS": "none"})
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert rows and all(not r["allowed"] for r in rows if r["distribution"].startswith(
        "engine-test-plugin"))
    check = run_engine_cli(["plugins", "check", "--json"], test_plugins_dir,
                           {"ENGINE_PLUGINS": "none"})
    assert check.returncode == 0, check.stdout + check.stderr
    assert not [r for r in json.loads(check.stdout) if r["distribution"].startswith(
        "engine-test-plugin")]


def test_unknown_allowlist_item_fails(test_plugins_dir: Path) -> None:
    result = run_engine_cli(["plugins", "list", "--plugins", "engine-test-plugin-goood"],
                            test_plugins_dir)
    assert result.returncode == 2
    assert "'engine-test-plugin-goood'" in result.stderr and "not discovered" in result.stderr


def test_check_reports_each_broken_plugin_with_distribution_and_cause(
    test_plugins_dir: Path,
) -> None:
    result = run_engine_cli(["plugins", "check"], test_plugins_dir)
    assert result.returncode == 1
    out = result.stdout
    expected = {
        "test_import_error": ("engine-test-plugin-import-error 0.1.0",
                              "No module named 'engine_test_missing_dependency'"),
        "test_not_subclass": ("engine-test-plugin-not-subclass 0.1.0", "is not a subclass"),
        "test_abstract_left": ("engine-test-plugin-not-subclass 0.1.0", "abstract methods"),
        "test_sdk2_logger": ("engine-test-plugin-sdk2 0.1.0", "engine-plugin-sdk>=2.0"),
    }
    fail_lines = [line for line in out.splitlines() if line.startswith("FAIL")]
    for name, (dist, cause) in expected.items():
        [line, *_] = [x for x in fail_lines if f"plugin {name!r}" in x]
        assert dist in line and cause in line, line
    good = "engine.logits_processors:test_good_ban_token (engine-test-plugin-good 0.1.0)"
    assert f"OK    {good}" in out
    for dist in ("dup-a", "dup-b"):  # each loads; the shared name errs only where used
        assert (f"OK    engine.scheduling_policies:test_dup_policy (engine-test-plugin-{dist} "
                f"0.1.0)") in out


def test_check_one_good_plugin_passes(test_plugins_dir: Path) -> None:
    result = run_engine_cli(["plugins", "check", "test_good_ban_token"], test_plugins_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"engine-plugin-sdk {SDK_VERSION} (contract v1)"
    assert lines[2] == f"        built for engine-plugin-sdk>=1.0,<2; running {SDK_VERSION}"
    assert lines[-1] == "1 ok, 0 failed"


def test_check_json_reports_the_sdk_each_plugin_was_built_for(test_plugins_dir: Path) -> None:
    result = run_engine_cli(["plugins", "check", "test_good_lifo", "--json"], test_plugins_dir)
    [row] = json.loads(result.stdout)
    assert row["sdk"] == {
        "requirement": ">=1.0,<2", "sdk_version": SDK_VERSION, "running": SDK_VERSION,
        "summary": f"built for engine-plugin-sdk>=1.0,<2; running {SDK_VERSION}",
        "deprecated": [], "advice": []}


def test_check_by_distribution(test_plugins_dir: Path) -> None:
    result = run_engine_cli(["plugins", "check", "engine-test-plugin-sdk2", "--json"],
                            test_plugins_dir)
    assert result.returncode == 1
    [row] = json.loads(result.stdout)
    assert row["ok"] is False and "2.0" in row["error"] and SDK_VERSION in row["error"]
    assert row["sdk"] is None  # it never loaded


def test_check_lists_the_deprecated_sdk_features_a_plugin_uses(
    plugins_on_path: Path, deprecate_hook: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from engine.sdk import LogitsProcessor
    from engine.server.cli._main import main

    deprecate_hook(LogitsProcessor, "update_state", "update_state_v2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the check reports; it does not warn or fail
        status = main(["plugins", "check", "test_good_ban_token"])
    out = capsys.readouterr().out.splitlines()
    assert status == 0
    since = ".".join(SDK_VERSION.split(".")[:2])
    assert out[3] == (
        f"        deprecated: overrides engine.sdk.logits_processor.LogitsProcessor."
        f"update_state, which is deprecated since engine-plugin-sdk {since} and removed in "
        f"2.0 (the engine stops calling it then); implement update_state_v2 instead")
    assert out[-1] == "1 ok, 0 failed, 1 using deprecated SDK features"
