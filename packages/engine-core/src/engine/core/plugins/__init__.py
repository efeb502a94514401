"""The plugin catalog: discovery, allowlist, lazy validated loading, and the manifest.

See DESIGN §4.2 and ``docs/plugins/index.md``.
"""

from engine.core.plugins._allowlist import ENV_VAR, Allowlist, Decision
from engine.core.plugins._catalog import (
    CatalogRow,
    PluginCatalog,
    discover_entries,
    get_catalog,
    set_catalog,
)
from engine.core.plugins._compat import Compatibility, load_and_check
from engine.core.plugins._entry import (
    BUILTIN_DISTRIBUTIONS,
    FIRST_PARTY_DISTRIBUTIONS,
    PluginEntry,
    normalize_dist_name,
)
from engine.core.plugins._loader import import_object, load_entry
from engine.core.plugins._manifest import ManifestEntry, PluginManifest
from engine.core.plugins._precedence import TARGET_GROUPS

__all__ = [
    "BUILTIN_DISTRIBUTIONS",
    "ENV_VAR",
    "FIRST_PARTY_DISTRIBUTIONS",
    "TARGET_GROUPS",
    "Allowlist",
    "CatalogRow",
    "Compatibility",
    "Decision",
    "ManifestEntry",
    "PluginCatalog",
    "PluginEntry",
    "PluginManifest",
    "discover_entries",
    "get_catalog",
    "import_object",
    "load_and_check",
    "load_entry",
    "normalize_dist_name",
    "set_catalog",
]
