"""The SDK base: version recording, options, Support, errors, and no torch at import."""

from __future__ import annotations

import subprocess
import sys
from abc import abstractmethod

import pytest
from pydantic import Field

from engine.sdk import (
    PluginError,
    PluginOptions,
    SchedulingPolicy,
    StatLogger,
    Support,
    UnsupportedError,
    __version__,
    check_contract_version,
)
from engine.sdk.plugin import Plugin, major_of


def test_import_engine_sdk_does_not_import_torch() -> None:
    code = "import engine.sdk, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_subclass_records_sdk_version_at_creation() -> None:
    class Logger(StatLogger):
        def record(self, scheduler_stats: object, iteration_stats: object) -> None:
            pass

    assert Logger.sdk_version == __version__
    assert check_contract_version(Logger).ok


def test_explicit_sdk_version_is_kept_and_other_major_refused() -> None:
    class Future(Plugin):
        sdk_version = "2.1.0"

    class Child(Future):
        pass

    assert Future.sdk_version == "2.1.0"
    assert Child.sdk_version == __version__  # recorded anew for the subclass
    support = check_contract_version(Future)
    assert not support.ok
    assert "2.1.0" in support.reason and __version__ in support.reason


def test_major_of() -> None:
    assert major_of("1.4.2") == 1
    with pytest.raises(ValueError, match="not a semantic version"):
        major_of("v1")


def test_abstract_methods_are_enforced() -> None:
    class Incomplete(SchedulingPolicy):
        name = "incomplete"

    with pytest.raises(TypeError, match="abstract"):
        Incomplete(None)  # type: ignore[abstract,arg-type]


def test_options_must_be_plugin_options() -> None:
    with pytest.raises(TypeError, match="must be a subclass of engine.sdk.PluginOptions"):

        class Bad(Plugin):
            class Options:  # type: ignore[misc]
                pass


def test_extra_args_keys_are_inherited_and_stored_as_a_frozenset() -> None:
    class Tiered(Plugin):
        extra_args_keys = ("tier", "boost")  # type: ignore[assignment]  # any collection

    class Child(Tiered):
        pass

    assert Plugin.extra_args_keys == frozenset()
    assert StatLogger.extra_args_keys == frozenset()
    assert Tiered.extra_args_keys == frozenset({"tier", "boost"})
    assert Child.extra_args_keys is Tiered.extra_args_keys


@pytest.mark.parametrize(("keys", "message"), [
    ("tier", "must be a collection of strings"),
    (None, "must be a collection of strings"),
    (["tier", 3], "must hold non-empty strings, got 3"),
    ({""}, "must hold non-empty strings, got ''"),
])
def test_extra_args_keys_must_be_strings(keys: object, message: str) -> None:
    with pytest.raises(TypeError, match=f"Bad.extra_args_keys {message}"):

        class Bad(Plugin):
            extra_args_keys = keys  # type: ignore[assignment]


def test_options_reject_unknown_keys_and_validate() -> None:
    class WithOptions(Plugin):
        class Options(PluginOptions):
            strength: float = Field(1.0, ge=0)

    assert WithOptions.Options(strength=2).strength == 2
    with pytest.raises(ValueError, match="strength"):
        WithOptions.Options(strength=-1)
    with pytest.raises(ValueError, match="extra"):
        WithOptions.Options(strenght=1)  # type: ignore[call-arg]


def test_support() -> None:
    assert Support.yes() and Support.yes().reason == ""
    assert not Support.no("because")
    with pytest.raises(ValueError, match="needs a reason"):
        Support(False)


def test_plugin_error_message_shape() -> None:
    err = PluginError("it broke", plugin="p", group="engine.x", distribution="d", version="1.2")
    assert str(err) == "plugin 'p' (group engine.x, distribution d 1.2): it broke"
    err = PluginError("it broke", plugin="m:C", group="engine.x")
    assert "not from an installed distribution" in str(err)


def test_unsupported_error_lists_reasons() -> None:
    err = UnsupportedError("no kernel fits", [("a", "too old"), ("b", "disabled")])
    assert str(err).splitlines() == ["no kernel fits", "  - a: too old", "  - b: disabled"]


def test_abstractmethod_on_plugin_subclass_blocks_instantiation() -> None:
    from abc import ABC

    class Base(Plugin, ABC):
        @abstractmethod
        def run(self) -> None: ...

    with pytest.raises(TypeError):
        Base()  # type: ignore[abstract]
