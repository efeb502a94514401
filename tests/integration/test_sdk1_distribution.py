"""The frozen SDK 1.0 plugins as a whole, and the ones every process loads.

``packages/testing-fixtures/plugins/sdk1`` (``engine-test-plugin-sdk1``) was written once
against engine-plugin-sdk 1.0.0 and is never edited: its files' hash is checked here. The
other tests check the whole distribution (``engine plugins check`` / ``list``, the
allowlist) and the plugins every process loads: the general plugin and the platform.

The ``test_sdk1_*.py`` files together prove that each of its plugins, one per group, is
still *reached* (its counter in ``engine_test_plugin_sdk1.counters.CALLS`` moves, or its
effect shows) and still *selective* (runs and requests that do not select it are
untouched). A failure means a later SDK or engine broke a 1.0 plugin: fix the SDK or the
engine, or the change needs a major version. Never "fix" the plugin. Shared helpers:
``engine.testing.sdk1``; fixtures: ``conftest.py``.

SDK deprecation warnings are shown, not raised: a feature deprecated in a later 1.x keeps
working until 2.0, so a 1.0 plugin that uses it must still pass (every other warning is
still an error).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from engine.core.plugins import Allowlist, PluginCatalog
from engine.sdk import groups as sdk_groups
from engine.testing.engine import assert_kv_pool_full
from engine.testing.sdk1 import (
    DIST,
    ENTRIES,
    SDK1_SOURCE,
    counting,
    greedy,
    sdk1_catalog,
    sdk1_llm,
)
from engine.testing.test_plugins import run_engine_cli

pytestmark = pytest.mark.filterwarnings("default::engine.sdk.deprecation.SDKDeprecationWarning")

#: Groups added after 1.0, which a 1.0 plugin cannot know.
GROUPS_SINCE_1_1 = {sdk_groups.STRUCTURED_OUTPUT_BACKENDS, sdk_groups.TOOL_PARSERS}

#: sha256 over every file of plugins/sdk1 (see ``_tree_sha256``). It never changes.
FROZEN_SHA256 = "ce3c77bc73b3293c5cd882b0aee5ded4de5c6139a988196328dd0804cfba8a34"


def _tree_sha256(root: Path) -> str:
    """sha256 over (relative path, sha256 of content) of every file, sorted by path."""
    digest = hashlib.sha256()
    files = [p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    for path in sorted(files, key=lambda p: p.relative_to(root).as_posix()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def test_frozen_sources_are_unchanged() -> None:
    assert _tree_sha256(SDK1_SOURCE) == FROZEN_SHA256, (
        f"the files of {SDK1_SOURCE} changed. They are FROZEN: written once against "
        f"engine-plugin-sdk 1.0.0 and never edited, so that CI proves every later 1.x SDK "
        f"and engine still runs a 1.0 plugin unchanged. Restore them. If a test of "
        f"{DIST} fails, fix the SDK or the engine (or the change needs SDK 2.0), never the "
        f"plugin (see {SDK1_SOURCE / 'README.md'})")


def test_plugins_check_reports_every_entry_ok(sdk1_plugin_dir: Path) -> None:
    # --plugins keeps other distributions (e.g. engine-kernels' ops) out of the check.
    result = run_engine_cli(["plugins", "check", DIST, "--plugins", DIST, "--json"],
                            sdk1_plugin_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(result.stdout)
    assert {r["group"]: r["name"] for r in rows} == ENTRIES and len(rows) == len(ENTRIES)
    assert set(ENTRIES) == set(sdk_groups.GROUPS) - GROUPS_SINCE_1_1, (
        "one plugin per entry-point group of SDK 1.0")
    for row in rows:
        assert row["ok"] and row["error"] is None, row
        assert (row["distribution"], row["version"]) == (DIST, "1.0.0")


def test_endpoint_is_opt_in_and_everything_else_is_allowed(sdk1: Path) -> None:
    unset = PluginCatalog.discover(Allowlist.from_env(None))
    decisions = {e.group: unset.decision(e) for e in unset.entries if e.distribution == DIST}
    assert set(decisions) == set(ENTRIES)
    assert not decisions[sdk_groups.ENDPOINTS].allowed
    assert "opt-in" in decisions[sdk_groups.ENDPOINTS].reason
    assert all(d.allowed for g, d in decisions.items() if g != sdk_groups.ENDPOINTS)
    assert ENTRIES[sdk_groups.ENDPOINTS] in sdk1_catalog().names(sdk_groups.ENDPOINTS)


def test_general_plugin_runs_once_per_process(tiny_llama: Path, sdk1: Path) -> None:
    import os

    from engine_test_plugin_sdk1 import general
    from engine_test_plugin_sdk1.counters import CALLS

    none = PluginCatalog.discover(Allowlist.from_env("none"))
    assert ENTRIES[sdk_groups.GENERAL_PLUGINS] not in none.names(sdk_groups.GENERAL_PLUGINS)
    with counting() as calls:
        none.run_general_plugins()
    assert calls["sdk1_register.call"] == 0  # not allowed: not called
    with sdk1_llm(tiny_llama):
        pass
    with sdk1_llm(tiny_llama):  # a second engine in the same process: not called again
        pass
    assert CALLS["sdk1_register.call"] == 1
    assert os.environ[general.ENV_MARKER] == str(os.getpid())
    assert general.REGISTRY == {"sdk1": DIST}


def test_platform_claims_the_host_only_when_enabled(
        tiny_llama: Path, sdk1: Path, reference: list[list[int]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    with counting() as calls, sdk1_llm(tiny_llama) as llm:
        assert llm.llm_engine.setup.platform.name == "cpu"
    assert calls["sdk1_cpu.detect"] >= 1 and calls["sdk1_cpu.check_and_update_config"] == 0
    monkeypatch.setenv("ENGINE_TEST_SDK1_PLATFORM", "1")
    with counting() as calls, sdk1_llm(tiny_llama, dtype="auto") as llm:
        setup = llm.llm_engine.setup
        assert setup.platform.name == "sdk1_cpu"
        assert setup.block_size == 32  # check_and_update_config chose it (no --block-size)
        assert setup.dtype is torch.float32
        assert llm.llm_engine.core.worker.built.backend.name == "sdk1_paged"  # its default
        assert setup.enforce_eager is True  # check_and_update_config set it: applied
        assert greedy(llm) == reference
        assert_kv_pool_full(llm)
    assert calls["sdk1_cpu.is_available"] >= 1 and calls["sdk1_paged.forward"] > 0
    assert calls["sdk1_cpu.default_attention_backend"] >= 1


def test_plugins_list_shows_each_op_implementation(sdk1_plugin_dir: Path) -> None:
    listed = run_engine_cli(["plugins", "list", "--plugins", DIST], sdk1_plugin_dir)
    assert listed.returncode == 0, listed.stderr
    assert ("  rms_norm = engine_test_plugin_sdk1.ops:Sdk1RMSNorm "
            f"({DIST} 1.0.0)  [default: ranks first with a cpu path (priority 0, a third "
            "party's over the engine's)]") in listed.stdout
    assert ("  silu_and_mul = engine.kernels.ops:SiluAndMul (engine-kernels 0.1.0)  [default: "
            "the only implementation with a cpu path]") in listed.stdout
    off = run_engine_cli(["plugins", "list", "--plugins", DIST, "--custom-ops=-rms_norm",
                          "--json"], sdk1_plugin_dir)
    assert off.returncode == 0, off.stderr
    [row] = [r for r in json.loads(off.stdout)  # (engine-kernels' ops are listed too)
             if r["group"] == sdk_groups.CUSTOM_OPS and r["distribution"] == DIST]
    assert (row["name"], row["used"], row["used_reason"]) == (
        "rms_norm", False, "--custom-ops: -rms_norm")
    bad = run_engine_cli(["plugins", "list", "--plugins", DIST, "--custom-ops", "+rms"],
                         sdk1_plugin_dir)
    assert bad.returncode == 2 and "rms_norm, rotary_embedding, silu_and_mul" in bad.stderr
