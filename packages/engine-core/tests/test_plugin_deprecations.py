"""A plugin using a deprecated SDK hook is warned about once, by name, and keeps loading."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import pytest

from engine.core.plugins import Allowlist, PluginCatalog, PluginEntry, load_and_check, load_entry
from engine.sdk import LogitsProcessor, SchedulingPolicy
from engine.sdk.deprecation import SDKDeprecationWarning
from engine.sdk.groups import LOGITS_PROCESSORS, SCHEDULING_POLICIES

GOOD = "distribution engine-test-plugin-good 0.1.0"


def catalog() -> PluginCatalog:
    return PluginCatalog.discover(Allowlist.parse("engine-test-plugin-good"))


def test_loading_a_plugin_that_overrides_a_deprecated_hook_warns_naming_it(
    plugins_on_path: Path, deprecate_hook: Any, caplog: pytest.LogCaptureFixture
) -> None:
    deprecate_hook(LogitsProcessor, "is_argmax_invariant", "new_invariance_hook")
    with pytest.warns(SDKDeprecationWarning) as record, caplog.at_level(logging.WARNING):
        cls = catalog().load(LOGITS_PROCESSORS, "test_good_ban_token")
    who = f"plugin 'test_good_ban_token' (group engine.logits_processors, {GOOD})"
    what = ("overrides engine.sdk.logits_processor.LogitsProcessor.is_argmax_invariant, which is "
            "deprecated since engine-plugin-sdk 1.1 and removed in 2.0 (the engine stops "
            "calling it then); implement new_invariance_hook instead")
    [message] = [str(w.message) for w in record]
    # Named when the class is created (first import) or else when the engine loads it.
    assert message in (f"{who}: {what}", f"{who}, class BanTokenProcessor: {what}")
    assert message in caplog.text  # operators see it in the log
    assert cls.__name__ == "BanTokenProcessor"  # still loads
    with warnings.catch_warnings():  # once per plugin and process
        warnings.simplefilter("error")
        catalog().load(LOGITS_PROCESSORS, "test_good_ban_token")


def test_plugins_not_overriding_the_deprecated_hook_are_not_warned(
    plugins_on_path: Path, deprecate_hook: Any
) -> None:
    deprecate_hook(SchedulingPolicy, "can_admit", "admission_hook")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        policy = catalog().load(SCHEDULING_POLICIES, "test_good_lifo")
    assert "can_admit" not in policy.__dict__


def test_plugins_check_reports_sdk_range_and_deprecated_use(
    plugins_on_path: Path, deprecate_hook: Any
) -> None:
    deprecate_hook(LogitsProcessor, "update_state", "a new hook")
    entry = catalog().resolve(LOGITS_PROCESSORS, "test_good_ban_token")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the check records, it does not raise
        _, compat = load_and_check(entry, load_entry)
    assert compat.requirement == ">=1.0,<2"
    assert compat.describe() == "built for engine-plugin-sdk>=1.0,<2; running 1.1.0"
    assert compat.deprecated == (
        "overrides engine.sdk.logits_processor.LogitsProcessor.update_state, which is "
        "deprecated since engine-plugin-sdk 1.1 and removed in 2.0 (the engine stops calling "
        "it then); a new hook",)
    assert compat.advice == ()


def test_plugins_check_advises_a_distribution_without_an_sdk_requirement() -> None:
    entry = PluginEntry(LOGITS_PROCESSORS, "x", "engine.core.logits_processors:"
                        "MinPLogitsProcessor", "pytest", "8.0")
    _, compat = load_and_check(entry, load_entry)
    assert compat.requirement is None
    assert compat.describe().startswith("declares no engine-plugin-sdk requirement")
    assert compat.advice == ('declare the SDK it needs: dependencies = ["engine-plugin-sdk>=1.N,'
                             '<2"] (N: the newest SDK feature it uses)',)
