"""The base every SDK ABC shares: contract-version recording and plugin options.

Every class a plugin author writes (a ``LogitsProcessor``, an ``AttentionBackend``, ...)
inherits from :class:`Plugin` through its ABC. Three things happen at class creation:

* the SDK version the class was built against is recorded in ``sdk_version`` (unless the
  class body sets it itself, e.g. to state the contract it was written for), and the
  engine refuses at load time a class whose major version differs from the installed SDK;
* ``Options`` names a pydantic model the engine validates the operator's
  ``--plugin-option NAME.KEY=VALUE`` settings against before the plugin is constructed;
* a class that overrides a deprecated hook gets an
  :class:`~engine.sdk.deprecation.SDKDeprecationWarning` naming it (since 1.1).

Example::

    class MyProcessor(LogitsProcessor):
        class Options(PluginOptions):
            strength: float = Field(1.0, ge=0, description="how hard to push")

        def __init__(self, ctx: LogitsProcessorContext) -> None:
            self.strength = ctx.options.strength  # validated, typed

.. versionadded:: 1.0
"""

from __future__ import annotations

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

    .. versionadded:: 1.0
    """

    sdk_version: ClassVar[str] = __version__
    Options: ClassVar[type[PluginOptions]] = PluginOptions

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
        warn_overridden_hooks(cls)


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
