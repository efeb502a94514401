"""The plugin allowlist: ``ENGINE_PLUGINS`` / ``--plugins``.

* unset: every discovered plugin is allowed, except ``engine.endpoints`` (opt-in);
* ``none``: no plugin is allowed;
* ``a,b,...``: each item is a distribution name (``my-plugins``) or a ``group:name`` entry
  (``engine.logits_processors:no_repeat``, the ``engine.`` prefix may be left out);
* an empty value is an error (vLLM reads it as "load nothing", which hides typos);
* an item that matches nothing discovered is an error.

The engine's built-in entries (``engine-core``, ``engine-server``) are always available.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from engine.core.plugins._entry import PluginEntry, normalize_dist_name
from engine.sdk.errors import ValidationError
from engine.sdk.groups import GROUPS

ENV_VAR = "ENGINE_PLUGINS"


@dataclass(frozen=True)
class Decision:
    """Whether an entry is allowed, and why (shown by ``engine plugins list``)."""

    allowed: bool
    reason: str


def _normalize_item(item: str) -> str:
    if ":" in item:
        group, _, name = item.partition(":")
        group = group.strip()
        if not group.startswith("engine."):
            group = f"engine.{group}"
        return f"{group}:{name.strip()}"
    return normalize_dist_name(item)


@dataclass(frozen=True)
class Allowlist:
    """A parsed allowlist. Build one with :meth:`parse` or :meth:`from_env`."""

    mode: Literal["all", "none", "list"]
    items: frozenset[str] = frozenset()
    source: str = ENV_VAR

    @classmethod
    def parse(cls, value: str | None, *, source: str = ENV_VAR) -> Allowlist:
        """Parse ``value`` (None = unset).

        Raises:
            ValidationError: the value is empty or has an empty item.
        """
        if value is None:
            return cls("all", source=source)
        text = value.strip()
        if not text:
            raise ValidationError(
                f"{source} is set but empty. To load no plugins set {source}=none; to load "
                f"all of them unset it; or list distributions and/or group:name entries "
                f"separated by commas (e.g. {source}=my-plugins,engine.endpoints:echo).",
                param=source,
            )
        if text.lower() == "none":
            return cls("none", source=source)
        raw_items = [item.strip() for item in text.split(",")]
        if any(not item for item in raw_items):
            raise ValidationError(
                f"{source}={value!r} has an empty item; separate distribution names or "
                f"group:name entries with single commas, or use {source}=none for no plugins.",
                param=source,
            )
        return cls("list", frozenset(_normalize_item(item) for item in raw_items), source)

    @classmethod
    def from_env(cls, override: str | None = None) -> Allowlist:
        """The allowlist from ``--plugins`` (``override``) or else ``ENGINE_PLUGINS``."""
        if override is not None:
            return cls.parse(override, source="--plugins")
        return cls.parse(os.environ.get(ENV_VAR), source=ENV_VAR)

    def decide(self, entry: PluginEntry) -> Decision:
        """Whether ``entry`` is allowed under this allowlist."""
        if entry.is_builtin:
            return Decision(True, "built-in")
        if entry.is_first_party:  # engine-kernels: the engine's own kernels, not an add-on
            return Decision(True, "the engine's own kernels")
        spec = GROUPS.get(entry.group)
        named = entry.distribution in self.items or f"{entry.group}:{entry.name}" in self.items
        if self.mode == "none":
            return Decision(False, f"{self.source}=none")
        if self.mode == "list":
            if named:
                return Decision(True, f"named in {self.source}")
            return Decision(False, f"not named in {self.source}")
        if spec is not None and spec.opt_in:
            return Decision(
                False,
                f"{entry.group} plugins are opt-in: name it in {self.source} "
                f"(e.g. {self.source}={entry.distribution or entry.group + ':' + entry.name})",
            )
        return Decision(True, f"{self.source} unset: all plugins allowed")

    def check_items_exist(self, entries: Iterable[PluginEntry]) -> None:
        """Raise if an item names neither a discovered distribution nor a discovered entry.

        Raises:
            ValidationError: naming the unknown items and what was discovered.
        """
        if self.mode != "list":
            return
        entries = list(entries)
        known = {e.distribution for e in entries if e.distribution} | {
            f"{e.group}:{e.name}" for e in entries
        }
        unknown = sorted(self.items - known)
        if unknown:
            dists = sorted({e.distribution for e in entries if e.distribution and not e.is_builtin})
            raise ValidationError(
                f"{self.source} names {', '.join(repr(u) for u in unknown)}, which "
                f"{'was' if len(unknown) == 1 else 'were'} not discovered among installed "
                f"plugins. Installed plugin distributions: {', '.join(dists) or '(none)'}. "
                f"Items are distribution names or group:name entries; run `engine plugins "
                f"list` to see them. (A stale install can hide a plugin: reinstall it.)",
                param=self.source,
            )
