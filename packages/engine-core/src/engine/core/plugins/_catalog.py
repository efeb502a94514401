"""``PluginCatalog``: every plugin entry point installed in this process's environment.

One catalog per process (:func:`get_catalog`) reads ``importlib.metadata`` once and indexes
``(group, name) -> entry`` without importing any plugin code. Loading is lazy and validated
(:mod:`engine.core.plugins._loader`). The rules:

* several distributions may provide the same ``(group, name)``: in ``engine.custom_ops``
  and ``engine.models`` they are candidates, chosen elsewhere; in every other group a third
  party's entry takes precedence over the engine's own, and two third parties' are an error
  naming both, raised only when that name is used (:mod:`engine.core.plugins._precedence`);
* the allowlist decides what is available; every skipped entry is logged once at INFO;
* a plugin given as ``module:Class`` where a name is expected is loaded directly.
"""

from __future__ import annotations

import importlib.metadata
import logging
import threading
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from engine.core.plugins._allowlist import Allowlist, Decision
from engine.core.plugins._entry import PluginEntry, normalize_dist_name
from engine.core.plugins._loader import import_object, load_entry, plugin_error
from engine.core.plugins._precedence import TARGET_GROUPS, choose, standing
from engine.sdk.errors import PluginError
from engine.sdk.groups import GENERAL_PLUGINS, GROUPS

logger = logging.getLogger("engine.plugins")

_logged_skips: set[tuple[str, str, str | None]] = set()
#: General plugins already called in this process: (value, distribution).
_general_plugins_run: set[tuple[str, str | None]] = set()


def discover_entries() -> list[PluginEntry]:
    """Every entry point in an ``engine.*`` group, from installed metadata (no imports)."""
    found: dict[tuple[str, str, str | None], PluginEntry] = {}
    for dist in importlib.metadata.distributions():
        dist_name = normalize_dist_name(dist.metadata["Name"] or "")
        for ep in dist.entry_points:
            if ep.group not in GROUPS:
                continue
            entry = PluginEntry(ep.group, ep.name, ep.value, dist_name, dist.version)
            # The same distribution seen twice on sys.path (e.g. a stale copy) counts once:
            # importlib lists the first one found, which is the one Python imports.
            found.setdefault((entry.group, entry.name, dist_name), entry)
    return sorted(found.values(), key=lambda e: (e.group, e.name, e.distribution or ""))


@dataclass(frozen=True)
class CatalogRow:
    """One line of ``engine plugins list``.

    Attributes:
        entry: The entry.
        decision: The allowlist's decision.
        conflicts_with: Allowed entries of equal standing with the same name (an error
            when the name is used); always empty in the target groups.
        shadows: The engine's own allowed entries this third-party entry takes precedence
            over.
        shadowed_by: The third-party allowed entry that takes precedence over this one of
            the engine's own.
    """

    entry: PluginEntry
    decision: Decision
    conflicts_with: tuple[PluginEntry, ...]
    shadows: tuple[PluginEntry, ...] = ()
    shadowed_by: tuple[PluginEntry, ...] = ()


class PluginCatalog:
    """The plugins installed for this process, their allowlist status, and lazy loading."""

    def __init__(self, entries: Iterable[PluginEntry], allowlist: Allowlist) -> None:
        self.entries = list(entries)
        self.allowlist = allowlist
        allowlist.check_items_exist(self.entries)
        self._decisions = {id(e): allowlist.decide(e) for e in self.entries}
        self._by_key: dict[tuple[str, str], list[PluginEntry]] = defaultdict(list)
        for entry in self.entries:
            self._by_key[entry.key].append(entry)
        self._loaded: dict[tuple[str, str, str, str | None], Any] = {}
        self._lock = threading.Lock()
        self._log_skips()

    @classmethod
    def discover(cls, allowlist: Allowlist | None = None) -> PluginCatalog:
        """Read installed metadata. ``allowlist`` defaults to ``ENGINE_PLUGINS``."""
        return cls(discover_entries(), allowlist or Allowlist.from_env())

    def _log_skips(self) -> None:
        for entry in self.entries:
            decision = self.decision(entry)
            marker = (entry.group, entry.name, entry.distribution)
            if not decision.allowed and marker not in _logged_skips:
                _logged_skips.add(marker)
                logger.info(
                    "Skipping plugin %r (group %s, distribution %s): %s",
                    entry.name, entry.group, entry.provider, decision.reason,
                )

    # -- inspection -------------------------------------------------------------------------

    def decision(self, entry: PluginEntry) -> Decision:
        """The allowlist's decision for ``entry``."""
        return self._decisions.get(id(entry)) or self.allowlist.decide(entry)

    def rows(self) -> list[CatalogRow]:
        """Every entry with its decision and how it stands against same-named entries.

        Only allowed entries count: once the allowlist keeps one of two same-named entries,
        there is nothing left to report. In the target groups (custom ops, models)
        same-named entries are candidates, so their rows report nothing.
        """
        rows = []
        for entry in self.entries:
            others: list[PluginEntry] = []
            if self.decision(entry).allowed and entry.group not in TARGET_GROUPS:
                others = [e for e in self.candidates(entry.group, entry.name) if e is not entry]
            same = tuple(e for e in others if standing(e) == standing(entry))
            below = tuple(e for e in others if standing(e) > standing(entry))
            above = [e for e in others if standing(e) < standing(entry)]
            best = min(map(standing, above), default=None)
            winners = tuple(e for e in above if standing(e) == best)
            rows.append(CatalogRow(
                entry, self.decision(entry), same, shadows=() if same else below,
                shadowed_by=winners if len(winners) == 1 else ()))
        return rows

    def error(self, group: str, name: str, cause: str) -> PluginError:
        """A PluginError naming the plugin selected as ``name`` and its distribution."""
        try:
            return plugin_error(self.resolve(group, name), cause)
        except PluginError:
            return PluginError(cause, plugin=name, group=group)

    def allowed(self, group: str) -> list[PluginEntry]:
        """Allowed entries of ``group``, sorted by name."""
        return [e for e in self.entries if e.group == group and self.decision(e).allowed]

    def names(self, group: str) -> list[str]:
        """Names available in ``group`` (for error messages and CLI help)."""
        return sorted({e.name for e in self.allowed(group)})

    def candidates(self, group: str, name: str) -> list[PluginEntry]:
        """Every allowed entry of ``group`` named ``name`` (several distributions may)."""
        return [e for e in self._by_key.get((group, name), []) if self.decision(e).allowed]

    def resolve(self, group: str, name: str) -> PluginEntry:
        """The allowed entry ``name`` means in ``group``; ``module:Class`` is taken as is.

        Where several distributions provide ``name``, a third party's takes precedence over
        the engine's own (:func:`engine.core.plugins._precedence.choose`). A
        ``module:Class`` that an allowed entry points to resolves to that entry (with its
        distribution), so a class path can pick one of several same-named entries.

        Raises:
            PluginError: unknown name (listing the available ones), skipped by the allowlist
                (saying why), or provided by two third parties (naming both).
        """
        if group not in GROUPS:
            raise PluginError(f"unknown plugin group {group!r}; known: {', '.join(GROUPS)}")
        allowed = self.candidates(group, name)
        if allowed:
            return choose(allowed, self.allowlist.source)
        candidates = self._by_key.get((group, name), [])
        if candidates:
            entry = candidates[0]
            raise plugin_error(entry, f"it is installed but not allowed: "
                                      f"{self.decision(entry).reason}")
        if ":" in name:
            by_value = [e for e in self.allowed(group) if e.value == name]
            if by_value:
                return by_value[0]
            return PluginEntry(group, name, name, *_distribution_of(name))
        available = ", ".join(self.names(group)) or "(none installed)"
        raise PluginError(
            f"no plugin named {name!r} in group {group}. Available: {available}. A class can "
            f"also be given as 'package.module:ClassName'.",
            plugin=name, group=group,
        )

    # -- loading ----------------------------------------------------------------------------

    def load(self, group: str, name: str) -> Any:
        """Import and validate the plugin selected as ``name`` in ``group`` (cached)."""
        return self.load_resolved(self.resolve(group, name))

    def load_resolved(self, entry: PluginEntry) -> Any:
        """Import and validate ``entry`` itself (cached): one of several same-named entries."""
        key = (entry.group, entry.name, entry.value, entry.distribution)
        with self._lock:
            if key not in self._loaded:
                self._loaded[key] = load_entry(entry)
            return self._loaded[key]

    def load_group(self, group: str) -> dict[str, Any]:
        """Import and validate every allowed entry of ``group`` (all-loaded groups)."""
        return {name: self.load(group, name) for name in self.names(group)}

    def run_general_plugins(self) -> None:
        """Call every allowed ``engine.general_plugins`` callable, once per process.

        A callable that already ran in this process (from an earlier catalog, e.g. a second
        ``LLM`` in the same interpreter) is not called again.

        Raises:
            PluginError: a callable failed to import or raised.
        """
        for name in self.names(GENERAL_PLUGINS):
            entry = self.resolve(GENERAL_PLUGINS, name)
            marker = (entry.value, entry.distribution)
            if marker in _general_plugins_run:
                continue
            _general_plugins_run.add(marker)
            func = self.load(GENERAL_PLUGINS, name)
            try:
                func()
            except Exception as exc:
                raise plugin_error(
                    entry, f"calling {entry.value}() raised {type(exc).__name__}: {exc}"
                ) from exc


def _distribution_of(path: str) -> tuple[str | None, str | None]:
    """Best-effort distribution and version of the module a ``module:Class`` path names."""
    top = path.partition(":")[0].split(".")[0]
    dists = importlib.metadata.packages_distributions().get(top, [])
    if len(dists) != 1:
        return None, None
    try:
        return normalize_dist_name(dists[0]), importlib.metadata.version(dists[0])
    except importlib.metadata.PackageNotFoundError:
        return None, None


_catalog: PluginCatalog | None = None
_catalog_lock = threading.Lock()


def get_catalog() -> PluginCatalog:
    """The process's catalog, discovered on first use with ``ENGINE_PLUGINS``."""
    global _catalog
    with _catalog_lock:
        if _catalog is None:
            _catalog = PluginCatalog.discover()
        return _catalog


def set_catalog(catalog: PluginCatalog | None) -> None:
    """Replace the process's catalog (``--plugins`` on the command line; tests)."""
    global _catalog
    with _catalog_lock:
        _catalog = catalog


__all__ = ["CatalogRow", "PluginCatalog", "discover_entries", "get_catalog", "import_object",
           "set_catalog"]
