"""Who is using a deprecated feature: the plugin and distribution behind a module.

Used by :mod:`engine.sdk.deprecation` to name the plugin in a warning. Reads installed
metadata only (``importlib.metadata``), never imports plugin code.
"""

from __future__ import annotations

import importlib.metadata
import sys
from types import FrameType

_SDK_PREFIX = "engine.sdk"
#: Standard-library modules whose frames sit between a class statement and the SDK's
#: ``__init_subclass__`` hooks, or between a caller and a decorator's wrapper.
_PASS_THROUGH = frozenset({"abc", "typing", "dataclasses", "functools"})


def is_sdk_module(module: str) -> bool:
    """True for ``engine.sdk`` and its submodules (the SDK's own frames)."""
    return module == _SDK_PREFIX or module.startswith(_SDK_PREFIX + ".")


def _passes_through(module: str) -> bool:
    return is_sdk_module(module) or module in _PASS_THROUGH


def caller_frame(depth: int) -> tuple[FrameType | None, int]:
    """The first frame outside the SDK and a few stdlib helpers, ``depth`` frames up or more.

    Returns:
        The frame (None when the stack ends inside the SDK) and its ``stacklevel`` as
        ``warnings.warn`` counts it from the function that called this one.
    """
    frame: FrameType | None = sys._getframe(depth + 1)
    level = depth + 1
    while frame is not None and _passes_through(str(frame.f_globals.get("__name__", ""))):
        frame = frame.f_back
        level += 1
    return frame, level


def _entries_of(dist: importlib.metadata.Distribution) -> list[importlib.metadata.EntryPoint]:
    return [ep for ep in dist.entry_points if ep.group.startswith("engine.")]


def _best_entries(
    entries: list[importlib.metadata.EntryPoint], module: str
) -> list[importlib.metadata.EntryPoint]:
    """The entries whose module is ``module``, or else the ones closest to it."""
    def shared(ep: importlib.metadata.EntryPoint) -> int:
        a, b = ep.module.split("."), module.split(".")
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    exact = [ep for ep in entries if ep.module == module]
    if exact or not entries:
        return exact
    best = max(shared(ep) for ep in entries)
    return [ep for ep in entries if shared(ep) == best]


def describe_user(module: str) -> str:
    """Name the plugin behind ``module`` for a message.

    Returns, from most to least precise:
    ``plugin 'name' (group G, distribution D V)``, ``distribution D V (plugins a, b)``,
    ``distribution D V (module m)``, or ``module m (not from an installed distribution)``.
    """
    top = module.split(".")[0]
    try:
        names = importlib.metadata.packages_distributions().get(top, [])
        dist = importlib.metadata.distribution(names[0]) if names else None
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is None:
        return f"module {module} (not from an installed distribution)"
    where = f"distribution {dist.metadata['Name']} {dist.version}"
    best = _best_entries(_entries_of(dist), module)
    if len(best) == 1:
        ep = best[0]
        return f"plugin {ep.name!r} (group {ep.group}, {where})"
    if best:
        return f"{where} (plugins {', '.join(sorted(ep.name for ep in best))})"
    return f"{where} (module {module})"
