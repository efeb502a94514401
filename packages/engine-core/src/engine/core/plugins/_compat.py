"""How a plugin fits the running SDK: the range it was built for and the deprecated API it uses.

What ``engine plugins check`` reports for each plugin. "Built for" is what the plugin's
distribution declares (its ``Requires-Dist`` on ``engine-plugin-sdk``, read from metadata):
that is the release of a plugin tied to an SDK major. The class's own ``sdk_version`` is
recorded at class creation, so it equals the running SDK unless the class pins it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.core.plugins._entry import PluginEntry
from engine.core.plugins._loader import SDK_DISTRIBUTION, sdk_requirement, spell_range
from engine.sdk._version import SDK_MAJOR
from engine.sdk._version import __version__ as SDK_VERSION
from engine.sdk.deprecation import Deprecation, SDKDeprecationWarning, overridden_hooks


@dataclass(frozen=True)
class Compatibility:
    """One plugin against the running SDK.

    Attributes:
        requirement: Its distribution's ``engine-plugin-sdk`` range (``">=1.0,<2"``), or
            None when it declares none.
        sdk_version: The class's ``sdk_version`` (None for callables).
        running_sdk: The installed ``engine-plugin-sdk``.
        deprecated: Each deprecated SDK feature it uses, as a sentence.
        advice: What its author should fix in its packaging.
    """

    requirement: str | None
    sdk_version: str | None
    running_sdk: str = SDK_VERSION
    deprecated: tuple[str, ...] = ()
    advice: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line: ``built for engine-plugin-sdk>=1.0,<2; running 1.1.0``."""
        if self.requirement is None:
            built = f"declares no {SDK_DISTRIBUTION} requirement"
        else:
            built = f"built for {SDK_DISTRIBUTION}{self.requirement or ' (any version)'}"
        if self.sdk_version and self.sdk_version != self.running_sdk:
            built += f", classes pinned to sdk_version {self.sdk_version}"
        return f"{built}; running {self.running_sdk}"


def _advice(entry: PluginEntry, requirement: str | None) -> tuple[str, ...]:
    if entry.distribution is None or entry.is_builtin:
        return ()
    if requirement is None:
        return (f"declare the SDK it needs: dependencies = [\"{SDK_DISTRIBUTION}>=1.N,"
                f"<{SDK_MAJOR + 1}\"] (N: the newest SDK feature it uses)",)
    if "<" not in requirement:
        return (f"its requirement {SDK_DISTRIBUTION}{requirement} has no upper bound: a future "
                f"major SDK would install beside it; add ,<{SDK_MAJOR + 1}",)
    return ()


def load_and_check(entry: PluginEntry, load: Callable[[PluginEntry], Any]) -> tuple[
        Any, Compatibility]:
    """``load(entry)``, recording the deprecated SDK features its import and class use.

    Raises:
        Whatever ``load`` raises (a PluginError for a plugin that does not load).
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SDKDeprecationWarning)
        obj = load(entry)
    # The hooks it overrides are read from the class (they were warned about at its creation,
    # which may have happened before this call); the rest from what its import emitted.
    used: list[Deprecation] = list(overridden_hooks(obj)) if isinstance(obj, type) else []
    for warning in caught:
        dep = getattr(warning.message, "deprecation", None)
        if isinstance(dep, Deprecation) and dep not in used:
            used.append(dep)
    specifier = sdk_requirement(entry)
    requirement = spell_range(specifier) if specifier is not None else None
    return obj, Compatibility(
        requirement=requirement,
        sdk_version=getattr(obj, "sdk_version", None) if isinstance(obj, type) else None,
        deprecated=tuple(dep.message() for dep in used),
        advice=_advice(entry, requirement),
    )
