"""Import one plugin entry and check it against its group's contract.

Every failure becomes one :class:`~engine.sdk.errors.PluginError` naming the plugin, group,
distribution and version, and the cause. Nothing is logged and skipped: a plugin that was
selected and does not load stops start-up.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from engine.core.plugins._entry import PluginEntry, normalize_dist_name
from engine.core.plugins._local import local_class
from engine.sdk._version import __version__ as SDK_VERSION
from engine.sdk.deprecation import warn_overridden_hooks
from engine.sdk.errors import PluginError
from engine.sdk.groups import GROUPS, GroupSpec
from engine.sdk.plugin import check_contract_version

SDK_DISTRIBUTION = "engine-plugin-sdk"


def plugin_error(entry: PluginEntry, cause: str) -> PluginError:
    """A PluginError for ``entry`` with ``cause``."""
    return PluginError(
        cause,
        plugin=entry.name,
        group=entry.group,
        distribution=entry.distribution,
        version=entry.version,
    )


def identity(entry: PluginEntry) -> str:
    """``plugin 'x' (group G, distribution D V)``: how every message names a plugin."""
    return str(plugin_error(entry, "")).removesuffix(": ")


def import_object(path: str) -> Any:
    """Import ``module:attr.sub`` (or ``module.attr``) and return the object.

    Raises:
        ImportError/AttributeError/...: whatever the import raises; callers wrap it.
    """
    local = local_class(path)
    if local is not None:
        return local
    if ":" in path:
        module_name, _, attr_path = path.partition(":")
    else:
        module_name, _, attr_path = path.rpartition(".")
    if not module_name or not attr_path:
        raise ValueError(f"{path!r} is not an import path; expected 'package.module:Name'")
    obj: Any = importlib.import_module(module_name)
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    return obj


def sdk_requirement(entry: PluginEntry) -> SpecifierSet | None:
    """The ``engine-plugin-sdk`` range the entry's distribution requires (None: none declared).

    Reads metadata only: no plugin code is imported.
    """
    if entry.distribution is None:
        return None
    try:
        requires = importlib.metadata.distribution(entry.distribution).requires or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for line in requires:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if normalize_dist_name(req.name) == SDK_DISTRIBUTION and req.marker is None:
            return req.specifier
    return None


def spell_range(specifier: SpecifierSet) -> str:
    """``>=1.0,<2`` with lower bounds first, so the range reads as the range it is."""
    return ",".join(sorted((str(s) for s in specifier), key=lambda s: s[0] != ">"))


def check_sdk_requirement(entry: PluginEntry) -> None:
    """Refuse a distribution whose ``engine-plugin-sdk`` requirement excludes the installed SDK.

    Reads metadata only: runs before any plugin code is imported.
    """
    specifier = sdk_requirement(entry)
    if specifier and not specifier.contains(Version(SDK_VERSION), prereleases=True):
        raise plugin_error(
            entry,
            f"it was built for {SDK_DISTRIBUTION}{spell_range(specifier)}, but the installed "
            f"{SDK_DISTRIBUTION} is {SDK_VERSION}; install a release of "
            f"{entry.distribution} built for SDK {SDK_VERSION.split('.')[0]}.x",
        )


def _contract_class(spec: GroupSpec) -> type | None:
    return import_object(spec.contract) if spec.contract and spec.kind == "class" else None


def validate_class(entry: PluginEntry, obj: Any, contract: type) -> None:
    """Check that ``obj`` is a concrete subclass of ``contract`` built for this SDK major."""
    contract_name = f"{contract.__module__}.{contract.__qualname__}"
    if not isinstance(obj, type):
        raise plugin_error(
            entry,
            f"{entry.value} is a {type(obj).__name__}, not a class; expected a subclass of "
            f"{contract_name}",
        )
    if not issubclass(obj, contract):
        raise plugin_error(
            entry, f"{entry.value} is not a subclass of {contract_name}"
        )
    if inspect.isabstract(obj):
        missing = sorted(getattr(obj, "__abstractmethods__", ()))
        raise plugin_error(
            entry,
            f"{entry.value} leaves abstract methods unimplemented: {', '.join(missing)}",
        )
    support = check_contract_version(obj)
    if not support.ok:
        raise plugin_error(entry, support.reason)
    # Deprecated hooks it overrides: one warning per plugin, naming it (DESIGN §4.4).
    warn_overridden_hooks(obj, user=identity(entry))


def load_entry(entry: PluginEntry) -> Any:
    """Import ``entry`` and validate it against its group's contract.

    Returns:
        The imported object (a class for "class" groups, a callable otherwise).

    Raises:
        PluginError: import failed, wrong type, abstract methods left, wrong SDK major.
    """
    spec = GROUPS.get(entry.group)
    if spec is None:
        raise plugin_error(entry, f"unknown group {entry.group!r}; known: {', '.join(GROUPS)}")
    check_sdk_requirement(entry)
    try:
        obj = import_object(entry.value)
    except Exception as exc:
        raise plugin_error(
            entry, f"importing {entry.value} failed: {type(exc).__name__}: {exc}"
        ) from exc
    contract = _contract_class(spec)
    if contract is not None:
        validate_class(entry, obj, contract)
    elif not callable(obj):
        raise plugin_error(
            entry, f"{entry.value} is a {type(obj).__name__}, which is not callable; "
            f"{entry.group} entries must be callables"
        )
    elif isinstance(obj, type) and hasattr(obj, "sdk_version"):
        support = check_contract_version(obj)
        if not support.ok:
            raise plugin_error(entry, support.reason)
    return obj
