"""Deprecation markers: each warns once per plugin, naming it, and keeps the feature working."""

from __future__ import annotations

import warnings
from abc import ABC
from pathlib import Path

import pytest

from engine.sdk import deprecation
from engine.sdk.deprecation import (
    SDKDeprecationWarning,
    deprecated,
    deprecated_alias,
    deprecated_argument,
    deprecated_hook,
    module_getattr,
    overridden_hooks,
    registered,
    warn_overridden_hooks,
)
from engine.sdk.plugin import Plugin


@pytest.fixture(autouse=True)
def fresh_once_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees every warning again (the SDK warns once per user and process)."""
    monkeypatch.setattr(deprecation, "_warned", set())


@deprecated(since="1.1", replacement="new_helper", name="engine.sdk.fake.old_helper")
def old_helper(x: int) -> int:
    return x + 1


def call_as(module: str, func: object, *args: object) -> object:
    """Call ``func`` from a frame whose module is ``module`` (as that module's code would)."""
    scope = {"__name__": module, "func": func, "args": args}
    exec(compile("result = func(*args)", f"<{module}>", "exec"), scope)
    return scope["result"]


def test_deprecated_function_keeps_working_and_warns_once_per_user() -> None:
    with pytest.warns(SDKDeprecationWarning) as record:
        assert old_helper(1) == 2
        assert old_helper(2) == 3  # same user: no second warning
        call_as("some_other_plugin.mod", old_helper, 3)
    messages = [str(w.message) for w in record]
    assert len(messages) == 2
    assert messages[0] == (
        f"module {__name__} (not from an installed distribution): uses "
        f"engine.sdk.fake.old_helper, deprecated since engine-plugin-sdk 1.1 and removed in "
        f"2.0; use new_helper instead")
    assert messages[1].startswith("module some_other_plugin.mod (not from an installed")
    assert record[0].filename == __file__  # points at the caller, not at the SDK


def test_warning_names_the_plugin_and_its_distribution(plugins_on_path: Path) -> None:
    with pytest.warns(SDKDeprecationWarning) as record:
        call_as("engine_test_plugin_good.processors", old_helper, 1)
        call_as("engine_test_plugin_good", old_helper, 1)
        call_as("engine_test_plugin_good.helpers", old_helper, 1)
    assert str(record[0].message).startswith(
        "plugin 'test_good_ban_token' (group engine.logits_processors, distribution "
        "engine-test-plugin-good 0.1.0): uses engine.sdk.fake.old_helper")
    assert str(record[1].message).startswith(
        "plugin 'test_good_register' (group engine.general_plugins, distribution")
    # A module no entry names: the distribution and the plugins it could belong to.
    assert str(record[2].message).startswith(
        "distribution engine-test-plugin-good 0.1.0 (plugins test_good_ban_token, "
        "test_good_counter, test_good_echo, test_good_lifo, test_good_register): uses")


def test_deprecated_class_warns_on_instantiation_and_subclassing() -> None:
    @deprecated(since="1.2", replacement="Use NewThing; it takes the same arguments.",
                name="engine.sdk.fake.OldThing")
    class OldThing:
        def __init__(self, value: int) -> None:
            self.value = value

    with pytest.warns(SDKDeprecationWarning, match="uses engine.sdk.fake.OldThing, deprecated "
                      "since engine-plugin-sdk 1.2 and removed in 2.0; Use NewThing"):
        assert OldThing(3).value == 3
    deprecation._warned.clear()
    with pytest.warns(SDKDeprecationWarning, match="OldThing"):
        class Child(OldThing):
            pass
    assert Child(4).value == 4


class Base(Plugin, ABC):
    """An SDK-style ABC with a deprecated hook and its replacement (module set below)."""

    @deprecated_hook(since="1.1", replacement="new_hook")
    def old_hook(self) -> int:
        return 1

    def new_hook(self) -> int:
        return self.old_hook()  # the default keeps old plugins working


Base.__module__ = "engine.sdk.fake_contract"


def test_overriding_a_deprecated_hook_warns_at_class_creation() -> None:
    with pytest.warns(SDKDeprecationWarning) as record:
        class OldPlugin(Base):
            def old_hook(self) -> int:
                return 7

    [warning] = record
    assert f"(not from an installed distribution), class {OldPlugin.__qualname__}: overrides " \
        in str(warning.message)
    assert "Base.old_hook, which is deprecated since engine-plugin-sdk 1.1 and removed in 2.0 " \
           "(the engine stops calling it then); implement new_hook instead" in str(warning.message)
    assert warning.filename == __file__  # the class statement, not abc.py or the SDK
    assert OldPlugin().new_hook() == 7  # still works through the new hook's default
    assert [d.target for d in overridden_hooks(OldPlugin)] == [
        f"{__name__}.Base.old_hook".lstrip("_")]
    # The engine loading it again names the plugin, but it is the same class: warned once.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_overridden_hooks(OldPlugin, user="plugin 'x' (group g)")


def test_plugins_using_the_new_hook_are_not_warned() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")

        class NewPlugin(Base):
            def new_hook(self) -> int:
                return 9

        assert NewPlugin().new_hook() == 9
        assert NewPlugin().old_hook() == 1  # calling the deprecated default warns nobody
    assert overridden_hooks(NewPlugin) == ()


def test_deprecated_argument_warns_and_forwards_to_its_new_name() -> None:
    @deprecated_argument("limit", since="1.1", replacement="max_items", rename_to="max_items")
    def take(items: list[int], max_items: int | None = None, limit: int | None = None) -> list[int]:
        return items[:max_items]

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert take([1, 2, 3], max_items=2) == [1, 2]  # the new name: silent
    with pytest.warns(SDKDeprecationWarning, match=r"passes the argument .*take\(limit\), "
                      r"deprecated since engine-plugin-sdk 1.1 .*use max_items instead"):
        assert take([1, 2, 3], limit=1) == [1]
    with pytest.raises(TypeError, match="got both 'limit' .deprecated. and 'max_items'"):
        take([1], max_items=1, limit=1)
    with pytest.raises(ValueError, match="has no parameter 'nope'"):
        deprecated_argument("nope", since="1.1", replacement="x")(take)


def test_module_getattr_serves_a_deprecated_alias() -> None:
    getattr_ = module_getattr("engine.sdk.fake_module", OldName=deprecated_alias(
        dict, since="1.1", replacement="engine.sdk.fake_module.NewName"))
    with pytest.warns(SDKDeprecationWarning, match="uses engine.sdk.fake_module.OldName, "
                      "deprecated since .* use engine.sdk.fake_module.NewName instead"):
        assert getattr_("OldName") is dict
    with pytest.raises(AttributeError, match="has no attribute 'Other'"):
        getattr_("Other")
    assert "engine.sdk.fake_module.OldName" in {d.target for d in registered()}


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"since": "1", "replacement": "x"}, "since must be 'MAJOR.MINOR'"),
    ({"since": "1.1", "replacement": "x", "removed_in": "1.5"}, "later major release"),
    ({"since": "1.1", "replacement": "x", "removed_in": "2.1"}, "later major release"),
    ({"since": "1.1", "replacement": " "}, "needs a replacement"),
])
def test_invalid_markers_are_refused(kwargs: dict[str, str], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        deprecated(name=f"engine.sdk.fake.bad_{len(error)}", **kwargs)(lambda: None)


def test_one_target_deprecated_twice_differently_is_refused() -> None:
    deprecated(since="1.1", replacement="a", name="engine.sdk.fake.twice")(lambda: None)
    with pytest.raises(ValueError, match="deprecated twice, differently"):
        deprecated(since="1.1", replacement="b", name="engine.sdk.fake.twice")(lambda: None)


def test_the_released_sdk_registers_no_deprecation_it_does_not_list() -> None:
    import importlib
    import pkgutil

    import engine.sdk

    for module in pkgutil.walk_packages(engine.sdk.__path__, "engine.sdk."):
        importlib.import_module(module.name)
    page = (Path(__file__).parents[3] / "docs" / "plugins" / "deprecations.md").read_text()
    for dep in registered():
        if dep.target.startswith("engine.sdk.") and ".fake" not in dep.target:
            assert f"`{dep.target}`" in page, f"{dep.target} is missing from deprecations.md"
