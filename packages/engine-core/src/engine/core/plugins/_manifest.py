"""``PluginManifest``: the resolved plugin set, sent with the config to every process.

The front end resolves which plugins are in use into a manifest. EngineCore and every
worker receive it with the engine configuration and check that their own environment has
the same distributions at the same versions before loading anything, so a registration can
never be present in one process and missing in another.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from engine.core.plugins._catalog import PluginCatalog
from engine.core.plugins._entry import PluginEntry
from engine.sdk.errors import PluginError


class ManifestEntry(BaseModel):
    """One selected plugin: where it comes from and the options it was given."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    group: str
    name: str
    value: str
    distribution: str | None
    version: str | None
    options: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def from_entry(cls, entry: PluginEntry, options: dict[str, Any] | None = None) -> ManifestEntry:
        """The manifest line for a catalog entry."""
        return cls(
            group=entry.group, name=entry.name, value=entry.value,
            distribution=entry.distribution, version=entry.version, options=options or {},
        )


class PluginManifest(BaseModel):
    """The plugins an engine uses, serialisable (JSON) for other processes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    entries: tuple[ManifestEntry, ...] = ()

    @classmethod
    def from_catalog(
        cls, catalog: PluginCatalog, *, groups: Iterable[str] | None = None
    ) -> PluginManifest:
        """Every allowed entry of ``groups`` (default: all groups).

        Same-named entries of several distributions are all listed: which one a name means
        is decided where it is used (:mod:`engine.core.plugins._precedence`), so installing a
        plugin never stops an engine that does not use it.
        """
        wanted = set(groups) if groups is not None else None
        return cls(entries=tuple(
            ManifestEntry.from_entry(e)
            for e in catalog.entries
            if catalog.decision(e).allowed and (wanted is None or e.group in wanted)
        ))

    def to_json(self) -> str:
        """Serialise for another process."""
        return self.model_dump_json()

    @classmethod
    def from_json(cls, data: str | bytes) -> PluginManifest:
        """The inverse of :meth:`to_json`."""
        return cls.model_validate_json(data)

    def verify(self, catalog: PluginCatalog, *, process: str) -> None:
        """Check that this process has the manifest's plugins at the same versions.

        Raises:
            PluginError: listing every entry that is missing or differs, for ``process``.
        """
        installed = {(e.group, e.name, e.distribution): e for e in catalog.entries}
        problems = []
        for item in self.entries:
            if item.distribution is None:
                continue
            here = installed.get((item.group, item.name, item.distribution))
            if here is None:
                problems.append(
                    f"{item.group}:{item.name} from {item.distribution} {item.version} is not "
                    f"installed here"
                )
            elif here.version != item.version or here.value != item.value:
                problems.append(
                    f"{item.group}:{item.name} is {item.distribution} {here.version} "
                    f"({here.value}) here but {item.version} ({item.value}) in the front end"
                )
        if problems:
            raise PluginError(
                f"the {process} process does not have the same plugins as the front end: "
                + "; ".join(problems)
                + ". Install the same plugin versions in every environment the engine uses."
            )
