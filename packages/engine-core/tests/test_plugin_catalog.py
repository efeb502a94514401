"""The plugin catalog against real installed test plugin distributions."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from engine.core.plugins import Allowlist, PluginCatalog, PluginManifest
from engine.sdk import PluginError, SamplingParams, ValidationError, __version__
from engine.sdk.groups import ENDPOINTS, LOGITS_PROCESSORS, SCHEDULING_POLICIES, STAT_LOGGERS


def catalog(value: str | None = None) -> PluginCatalog:
    return PluginCatalog.discover(Allowlist.parse(value))


def test_discovers_entries_with_distribution_and_version(plugins_on_path: Path) -> None:
    entries = {(e.group, e.name): e for e in catalog().entries}
    good = entries[(LOGITS_PROCESSORS, "test_good_ban_token")]
    assert good.distribution == "engine-test-plugin-good"
    assert good.version == "0.1.0"
    assert good.value == "engine_test_plugin_good.processors:BanTokenProcessor"


def test_discovery_imports_no_plugin_code(plugins_on_path: Path) -> None:
    import sys

    before = set(sys.modules)
    catalog()
    assert not [m for m in set(sys.modules) - before if m.startswith("engine_test_plugin")]


def test_good_plugin_loads_and_is_usable(plugins_on_path: Path) -> None:
    cls = catalog().load(LOGITS_PROCESSORS, "test_good_ban_token")
    assert cls.__name__ == "BanTokenProcessor"
    with pytest.raises(ValidationError, match="ban_token"):
        cls.validate_params(SamplingParams(extra_args={"ban_token": "x"}))


@pytest.mark.parametrize(
    ("name", "cause"),
    [
        ("test_import_error", "No module named 'engine_test_missing_dependency'"),
        ("test_not_subclass", "is not a subclass of engine.sdk.logits_processor"),
        ("test_abstract_left", "leaves abstract methods unimplemented: apply, is_argmax_invariant"),
    ],
)
def test_broken_plugins_name_plugin_group_distribution_and_cause(
    plugins_on_path: Path, name: str, cause: str
) -> None:
    with pytest.raises(PluginError) as info:
        catalog().load(LOGITS_PROCESSORS, name)
    message = str(info.value)
    assert f"plugin {name!r}" in message
    assert f"group {LOGITS_PROCESSORS}" in message
    assert "distribution engine-test-plugin-" in message and " 0.1.0" in message
    assert cause in message


def test_plugin_for_another_sdk_major_is_refused_naming_both_versions(
    plugins_on_path: Path,
) -> None:
    with pytest.raises(PluginError) as info:
        catalog().load(STAT_LOGGERS, "test_sdk2_logger")
    message = str(info.value)
    assert "engine-test-plugin-sdk2 0.1.0" in message
    assert ">=2.0" in message and f"installed engine-plugin-sdk is {__version__}" in message


def test_duplicate_name_from_two_distributions_is_an_error_naming_both_when_used(
    plugins_on_path: Path,
) -> None:
    cat = catalog()
    manifest = PluginManifest.from_catalog(cat)  # installing both stops no engine
    assert {e.distribution for e in manifest.entries if e.name == "test_dup_policy"} == {
        "engine-test-plugin-dup-a", "engine-test-plugin-dup-b"}
    with pytest.raises(PluginError) as info:
        cat.load(SCHEDULING_POLICIES, "test_dup_policy")
    message = str(info.value)
    assert message.startswith(
        f"plugin 'test_dup_policy' (group {SCHEDULING_POLICIES}, distributions "
        "engine-test-plugin-dup-a 0.1.0 and engine-test-plugin-dup-b 0.1.0): ")
    assert "not from an installed distribution" not in message
    assert ("giving its class path instead of the name where you select it "
            "(engine-test-plugin-dup-a's is engine_test_plugin_dup_a:Policy; "
            "engine-test-plugin-dup-b's is engine_test_plugin_dup_b:Policy)") in message
    assert "keep one with ENGINE_PLUGINS=<distribution>" in message
    assert (info.value.plugin, info.value.group) == ("test_dup_policy", SCHEDULING_POLICIES)
    # The class path picks one, and names its distribution.
    entry = cat.resolve(SCHEDULING_POLICIES, "engine_test_plugin_dup_b:Policy")
    assert entry.distribution == "engine-test-plugin-dup-b"
    assert cat.load(SCHEDULING_POLICIES, "engine_test_plugin_dup_b:Policy").__module__ == (
        "engine_test_plugin_dup_b")


def test_allowlist_by_distribution_resolves_a_duplicate(plugins_on_path: Path) -> None:
    cat = catalog("engine-test-plugin-dup-b")
    policy = cat.load(SCHEDULING_POLICIES, "test_dup_policy")
    assert policy.__module__ == "engine_test_plugin_dup_b"
    manifest = PluginManifest.from_catalog(cat)
    assert {e.distribution for e in manifest.entries} <= {
        "engine-test-plugin-dup-b", "engine-core", "engine-server", "engine-kernels"}


def test_none_allows_nothing(plugins_on_path: Path) -> None:
    cat = catalog("none")
    allowed = [e for e in cat.entries if cat.decision(e).allowed and not e.is_builtin]
    # The engine's kernels stay: the allowlist governs what third parties add.
    assert allowed and {e.distribution for e in allowed} == {"engine-kernels"}
    assert {cat.decision(e).reason for e in allowed} == {"the engine's own kernels"}
    with pytest.raises(PluginError, match="not allowed: ENGINE_PLUGINS=none"):
        cat.load(LOGITS_PROCESSORS, "test_good_ban_token")


def test_empty_allowlist_is_an_error_mentioning_none() -> None:
    with pytest.raises(ValidationError, match="ENGINE_PLUGINS=none"):
        Allowlist.parse("")
    with pytest.raises(ValidationError, match="empty item"):
        Allowlist.parse("a,,b")


def test_unknown_allowlist_item_is_an_error(plugins_on_path: Path) -> None:
    with pytest.raises(ValidationError, match="'no-such-plugin-dist'.*not discovered"):
        catalog("engine-test-plugin-good,no-such-plugin-dist")


def test_endpoints_are_opt_in(plugins_on_path: Path) -> None:
    default = catalog()
    [echo] = [e for e in default.entries if e.group == ENDPOINTS]
    decision = default.decision(echo)
    assert not decision.allowed and "opt-in" in decision.reason
    named = catalog("endpoints:test_good_echo")
    assert named.decision(next(e for e in named.entries if e.group == ENDPOINTS)).allowed
    # Named by group:name, only that entry is allowed: the rest of its distribution is not.
    assert [e for e in named.allowed(LOGITS_PROCESSORS) if not e.is_builtin] == []


def test_skips_are_logged_once(plugins_on_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from engine.core.plugins import _catalog

    _catalog._logged_skips.clear()
    with caplog.at_level(logging.INFO, logger="engine.plugins"):
        catalog("engine-test-plugin-good")
        catalog("engine-test-plugin-good")
    skips = [r.getMessage() for r in caplog.records if "Skipping plugin 'test_dup_policy'" in
             r.getMessage()]
    assert len(skips) == 2  # one per distribution providing it, each logged once
    assert all("not named in ENGINE_PLUGINS" in s for s in skips)


def test_general_plugins_run_once_per_process(plugins_on_path: Path) -> None:
    import os

    cat = catalog("engine-test-plugin-good")
    cat.run_general_plugins()
    import engine_test_plugin_good

    calls = engine_test_plugin_good.REGISTER_CALLS
    assert calls == 1  # ran exactly once in this process, whichever test got here first
    assert os.environ["ENGINE_TEST_PLUGIN_GOOD_REGISTERED"] == "1"
    cat.run_general_plugins()
    catalog("engine-test-plugin-good").run_general_plugins()  # a second engine, same process
    assert engine_test_plugin_good.REGISTER_CALLS == 1


def test_unknown_name_lists_available(plugins_on_path: Path) -> None:
    with pytest.raises(PluginError, match="Available: .*test_good_ban_token"):
        catalog("engine-test-plugin-good").load(LOGITS_PROCESSORS, "nope")


def test_module_path_is_accepted_where_a_name_is(plugins_on_path: Path) -> None:
    cls = catalog("none").load(
        LOGITS_PROCESSORS, "engine_test_plugin_good.processors:BanTokenProcessor"
    )
    assert cls.__name__ == "BanTokenProcessor"


def test_manifest_roundtrip_and_verification(plugins_on_path: Path) -> None:
    cat = catalog("engine-test-plugin-good")
    manifest = PluginManifest.from_catalog(cat)
    assert ("engine.logits_processors", "test_good_ban_token") in {
        (e.group, e.name) for e in manifest.entries
    }
    again = PluginManifest.from_json(manifest.to_json())
    assert again == manifest
    again.verify(cat, process="worker")  # same environment: fine


def test_manifest_verification_names_missing_and_differing_plugins(
    plugins_on_path: Path,
) -> None:
    cat = catalog("engine-test-plugin-good")
    data = PluginManifest.from_catalog(cat).model_dump()
    data["entries"] = list(data["entries"])
    data["entries"][0]["version"] = "9.9.9"
    data["entries"].append({**data["entries"][0], "name": "only_in_front_end"})
    with pytest.raises(PluginError) as info:
        PluginManifest.model_validate(data).verify(cat, process="EngineCore")
    message = str(info.value)
    assert "EngineCore process" in message
    assert "9.9.9" in message and "only_in_front_end" in message and "not installed here" in message
