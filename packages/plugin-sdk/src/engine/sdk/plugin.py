"""The base every SDK ABC shares: contract-version recording and plugin options.

Every class a plugin author writes (a ``LogitsProcessor``, an ``AttentionBackend``, ...)
inherits from :class:`Plugin` through its ABC. Four things happen at class creation:

* the SDK version the class was built against is recorded in ``sdk_version`` (unless the
  class body sets it itself, e.g. to state the contract it was written for), and the
  engine refuses at load time a class whose major version differs from the installed SDK;
* ``Options`` names a pydantic model the engine validates the operator's
  ``--plugin-option NAME.KEY=VALUE`` settings against before the plugin is constructed;
* a class that overrides a deprecated hook gets an
  :class:`~engine.sdk.deprecation.SDKDeprecationWarning` naming it (since 1.1);
* ``extra_args_keys`` (the keys of a request's ``SamplingParams.extra_args`` the plugin
  reads) is checked and made a ``frozenset`` (since 1.1). The front end refuses a request
  whose ``extra_args`` has a key that no plugin the engine uses takes (HTTP 400).

Example::

    class MyProcessor(LogitsProcessor):
        class Options(PluginOptions):
            strength: float = Field(1.0, ge=0, description="how hard to push")

        def __init__(self, ctx: LogitsProcessorContext) -> None:
            self.strength = ctx.options.strength  # validated, typed

    class TieredPolicy(SchedulingPolicy):
        extra_args_keys = frozenset({"tier"})  # requests may send extra_args={"tier": 2}

.. versionadded:: 1.0
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from engine.sdk._version import SDK_MAJOR, __version__
from engine.sdk.deprecation import warn_overridden_hooks
from engine.sdk.support import Support


class PluginOptions(BaseModel):
    """Base of a plugin's options model: frozen, unknown keys rejected.

    Subclass it as a nested ``Options`` class on the plugin. Field descriptions are shown by
    ``engine plugins check``; a validation failure names the key and what is allowed.

    .. versionadded:: 1.0
    """

    model_config = ConfigDict(frozen=True, extra="forbid")


class Plugin:
    """Mixin base of every SDK contract class.

    Attributes:
        sdk_version: The SDK version this class was built against, recorded at class
            creation. Set it in the class body to pin the contract explicitly.
        Options: The plugin's options model (default: accepts no options).
        extra_args_keys: The keys of a request's ``SamplingParams.extra_args`` this plugin
            reads (default: none). Any kind of plugin that sees requests declares its keys
            here: a scheduling policy or scheduler (``request.sampling_params``), a KV
            connector (on the ``KVConnector`` class; its scheduler side sees the requests),
            a logits processor (which may instead read them in ``validate_params``), ... A
            request whose ``extra_args`` has a key that no plugin the engine uses takes is
            refused (HTTP 400 naming the key and the keys that are taken, by which plugin).
            Give any collection of strings; it is stored as a ``frozenset``.

    .. versionadded:: 1.0
    .. versionchanged:: 1.1 Added ``extra_args_keys``.
    """

    sdk_version: ClassVar[str] = __version__
    Options: ClassVar[type[PluginOptions]] = PluginOptions
    extra_args_keys: ClassVar[frozenset[str]] = frozenset()
    """The ``extra_args`` keys this plugin reads (see the class docstring).

    .. versionadded:: 1.1
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "sdk_version" not in cls.__dict__:
            cls.sdk_version = __version__
        options = cls.__dict__.get("Options", cls.Options)
        if not (isinstance(options, type) and issubclass(options, PluginOptions)):
            raise TypeError(
                f"{cls.__qualname__}.Options must be a subclass of engine.sdk.PluginOptions, "
                f"got {options!r}"
            )
        if "extra_args_keys" in cls.__dict__:
            cls.extra_args_keys = _key_set(cls, cls.__dict__["extra_args_keys"])
        warn_overridden_hooks(cls)


def _key_set(cls: type, keys: object) -> frozenset[str]:
    """``keys`` as a frozenset of non-empty strings, or a TypeError naming ``cls``."""
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable):
        raise TypeError(f"{cls.__qualname__}.extra_args_keys must be a collection of strings "
                        f"(e.g. frozenset({{'my_key'}})), got {keys!r}")
    bad = [key for key in keys if not isinstance(key, str) or not key]
    if bad:
        raise TypeError(f"{cls.__qualname__}.extra_args_keys must hold non-empty strings, "
                        f"got {bad[0]!r}")
    return frozenset(keys)


def major_of(version: str) -> int:
    """The major component of a semver string (``"1.4.2"`` -> 1).

    Raises:
        ValueError: ``version`` does not start with an integer.

    .. versionadded:: 1.0
    """
    head = version.strip().split(".", 1)[0]
    if not head.isdigit():
        raise ValueError(f"not a semantic version: {version!r} (expected e.g. '1.0.0')")
    return int(head)


def check_contract_version(cls: type) -> Support:
    """Whether ``cls`` targets the contract major version of the installed SDK.

    Returns:
        ``Support.yes()`` when the majors match; otherwise a reason naming both versions.

    .. versionadded:: 1.0
    """
    built = getattr(cls, "sdk_version", None)
    if built is None:
        return Support.no("it does not record an SDK version (is it an engine.sdk class?)")
    try:
        major = major_of(str(built))
    except ValueError as exc:
        return Support.no(f"its sdk_version is invalid: {exc}")
    if major != SDK_MAJOR:
        return Support.no(
            f"it was built against engine-plugin-sdk {built} (contract v{major}), but the "
            f"installed engine-plugin-sdk is {__version__} (contract v{SDK_MAJOR}); install a "
            f"release of the plugin built for SDK {SDK_MAJOR}.x"
        )
    return Support.yes()
