"""Which of several same-named entries a name means: the precedence rule.

Two kinds of groups (DESIGN §1, §6):

* **Target groups** (:data:`TARGET_GROUPS`: ``engine.custom_ops``, ``engine.models``): the
  name is what an implementation serves (an op, an architecture), and several
  implementations of it, the engine's own among them, are candidates. They never conflict;
  ``engine.core.custom_op_selection`` and ``engine.core.model_selection`` choose among them.
* **Every other group**: the name identifies one plugin. Where a third party's entry and
  the engine's own (:data:`~engine.core.plugins._entry.FIRST_PARTY_DISTRIBUTIONS`) share a
  name, the third party's takes precedence, logged once per process; the engine's stays
  reachable by its class path (``module:Class``) wherever the name is given. Two third
  parties sharing a name are ambiguous: an error naming both and how to choose, raised only
  when the name is used (selected, or loaded because its group loads every entry).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from engine.core.plugins._entry import PluginEntry
from engine.sdk.errors import PluginError
from engine.sdk.groups import CUSTOM_OPS, MODELS

logger = logging.getLogger("engine.plugins")

#: Groups whose entry name is a target several implementations may serve.
TARGET_GROUPS = frozenset({CUSTOM_OPS, MODELS})

_logged: set[tuple[str, str, str | None]] = set()


def standing(entry: PluginEntry) -> int:
    """0: a third party's; 1: engine-kernels' (the engine's plugin package); 2: built in."""
    return 0 if not entry.is_first_party else 2 if entry.is_builtin else 1


def choose(entries: Sequence[PluginEntry], allowlist_source: str) -> PluginEntry:
    """The entry a name means among the allowed ``entries`` that share it (at least one).

    A third party's entry comes first, then engine-kernels' (a plugin package of the
    engine's), then the built-in one (engine-core's, engine-server's): in a target group
    that is the name's "replacement" when code asks for one by name (the choice proper is
    made by the target's own selection).

    Raises:
        PluginError: two or more entries of the same standing (two third parties'),
            naming every one and how to choose.
    """
    if len(entries) == 1:
        return entries[0]
    best = min(map(standing, entries))
    top = [e for e in entries if standing(e) == best]
    if len(top) > 1:
        raise ambiguity_error(top, allowlist_source)
    chosen = top[0]
    marker = (chosen.group, chosen.name, chosen.distribution)
    if marker not in _logged:
        _logged.add(marker)
        own = [e for e in entries if e is not chosen]
        logger.info(
            "plugin %r (group %s, distribution %s) takes precedence over the engine's own %s; "
            "to use the engine's, give it by its class path (%s) where you select %r",
            chosen.name, chosen.group, chosen.provider,
            " and ".join(f"{e.value} ({e.provider})" for e in own),
            " or ".join(e.value for e in own), chosen.name)
    return chosen


def ambiguity_error(entries: Sequence[PluginEntry], allowlist_source: str) -> PluginError:
    """The error for one name that several distributions of equal standing provide.

    ``PluginError`` names one distribution, or says "not from an installed distribution"
    when given none; here there are several, so the message names every one of them in the
    usual ``plugin 'x' (group G, ...)`` shape, and ``distribution`` stays None.
    """
    first = entries[0]
    providers = " and ".join(e.provider for e in entries)
    paths = "; ".join(f"{e.distribution}'s is {e.value}" for e in entries)
    cause = (f"{len(entries)} distributions provide {first.name!r}, and this engine uses it. "
             f"Choose one by giving its class path instead of the name where you select it "
             f"({paths}), or keep one with {allowlist_source}=<distribution>, or uninstall "
             f"all but one.")
    error = PluginError(f"plugin {first.name!r} (group {first.group}, distributions "
                        f"{providers}): {cause}")
    error.cause, error.plugin, error.group = cause, first.name, first.group
    return error


__all__ = ["TARGET_GROUPS", "ambiguity_error", "choose", "standing"]
