"""Which platform this process runs on.

Every allowed ``engine.platforms`` detector is called. An out-of-tree detector that claims
the host wins over the built-ins; two out-of-tree claims are an error naming both; among
the built-ins CUDA wins over the CPU. A detector that raises stops start-up with its
plugin's identity (no silent fallback to the CPU).
"""

from __future__ import annotations

import functools

from engine.core.plugins import PluginCatalog, get_catalog
from engine.core.plugins._loader import plugin_error
from engine.sdk.errors import PluginError
from engine.sdk.groups import PLATFORMS
from engine.sdk.platform import Platform

_BUILTIN_ORDER = ("cuda", "cpu")


def select_platform(catalog: PluginCatalog) -> type[Platform]:
    """Run the detectors of ``catalog`` and choose (see the module docstring)."""
    claims: list[tuple[str, bool, type[Platform], str]] = []
    for entry in catalog.allowed(PLATFORMS):
        detector = catalog.load_resolved(entry)
        try:
            result = detector()
        except Exception as exc:
            raise plugin_error(entry, f"its detector raised {type(exc).__name__}: {exc}") from exc
        if result is None:
            continue
        if not (isinstance(result, type) and issubclass(result, Platform)):
            raise plugin_error(entry, f"its detector returned {result!r}, not a subclass of "
                               f"engine.sdk.platform.Platform or None")
        claims.append((entry.name, entry.is_builtin, result, entry.provider))
    external = [c for c in claims if not c[1]]
    if len(external) > 1:
        names = " and ".join(f"{name!r} ({provider})" for name, _, _, provider in external)
        raise PluginError(f"two platform plugins claim this host: {names}. Uninstall one or "
                          f"keep one with ENGINE_PLUGINS.")
    if external:
        return external[0][2]
    builtin = {c[2].name: c[2] for c in claims if c[1]}
    for name in _BUILTIN_ORDER:
        if name in builtin:
            return builtin[name]
    from engine.core.platforms._builtin import CpuPlatform

    return CpuPlatform


@functools.cache
def current_platform() -> type[Platform]:
    """The platform of this process (selected once, from the process's catalog)."""
    return select_platform(get_catalog())
