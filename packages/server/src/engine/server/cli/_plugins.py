"""``engine plugins list|check``: show the plugin catalog, and validate plugins offline.

``list`` also shows, where several distributions provide one name, which one an engine
started here would use: each custom op's implementation among its candidates on this
host's platform (under the allowlist and ``--custom-ops`` given; the platform's own items
apply at start-up, and the worker logs the result), each architecture's model (under
``--model-impl``), and which plugin shadows one of the engine's own names.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from engine.core.plugins import (
    Allowlist,
    CatalogRow,
    Compatibility,
    PluginCatalog,
    load_and_check,
    load_entry,
)
from engine.sdk._version import SDK_MAJOR
from engine.sdk._version import __version__ as SDK_VERSION
from engine.sdk.errors import PluginError, ValidationError
from engine.sdk.groups import GROUPS
from engine.server.cli._help import HelpFormatter
from engine.server.cli._logging_args import add_log_level
from engine.server.cli._plugins_choices import mark_op_rows, plan_ops, print_models, print_ops


def add_parser(commands: Any) -> None:
    """Register ``plugins`` and its subcommands."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--plugins", default=None, metavar="ALLOWLIST",
        help="allowlist overriding ENGINE_PLUGINS: 'none', or comma-separated distribution "
             "names and group:name entries (default: $ENGINE_PLUGINS, else every plugin)",
    )
    common.add_argument("--json", action="store_true", help="machine-readable output")
    add_log_level(common, default_text="WARNING")
    parser = commands.add_parser("plugins", help="inspect installed plugins",
                                 formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="plugins_command", metavar="SUBCOMMAND")
    sub.required = True
    lister = sub.add_parser(
        "list", parents=[common], help="list every plugin entry point and whether it is allowed",
        formatter_class=HelpFormatter,
    )
    lister.add_argument(
        "--custom-ops", default="", metavar="ITEMS",
        help="show the custom-op implementations these items select (as for engine serve: "
             "all, none, +NAME, +NAME=CHOICE, -NAME, comma-separated; write "
             "--custom-ops=-NAME for a leading minus; default: the default rule)")
    lister.add_argument(
        "--model-impl", default="auto", metavar="IMPL",
        help="show the models this --model-impl selects where several serve one "
             "architecture (auto, engine, a distribution, or module:Class)")
    lister.set_defaults(handler=run_list)
    checker = sub.add_parser(
        "check", parents=[common], formatter_class=HelpFormatter,
        help="import and validate plugins without starting an engine: contract, options, the "
             "SDK each was built for, deprecated SDK features it uses (exit 1 on any failure)",
    )
    checker.add_argument(
        "name", nargs="?", default=None,
        help="only this plugin: an entry name, group:name, or a distribution name",
    )
    checker.set_defaults(handler=run_check)


def _catalog(args: argparse.Namespace) -> PluginCatalog | None:
    try:
        return PluginCatalog.discover(Allowlist.from_env(args.plugins))
    except ValidationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None


def _row_dict(row: CatalogRow) -> dict[str, Any]:
    entry = row.entry
    spec = GROUPS[entry.group]
    return {
        "group": entry.group,
        "name": entry.name,
        "value": entry.value,
        "distribution": entry.distribution,
        "version": entry.version,
        "allowed": row.decision.allowed,
        "reason": row.decision.reason,
        "processes": list(spec.processes),
        "conflicts": [f"{e.distribution} {e.version}" for e in row.conflicts_with],
        "shadows": [f"{e.distribution} {e.version}" for e in row.shadows],
        "shadowed_by": [f"{e.distribution} {e.version}" for e in row.shadowed_by],
    }


def _status(r: dict[str, Any]) -> str:
    """The note after a row: ambiguity, or which name precedence applies."""
    if r["conflicts"]:
        return (f"  CONFLICT with {', '.join(r['conflicts'])}: an error if this name is "
                f"used; select one by its class path (module:Class)")
    if r["shadows"]:
        return f"  takes precedence over the engine's own from {', '.join(r['shadows'])}"
    if r["shadowed_by"]:
        return (f"  shadowed by {', '.join(r['shadowed_by'])}; select this one by its class "
                f"path")
    return ""


def run_list(args: argparse.Namespace) -> int:
    """``engine plugins list``."""
    catalog = _catalog(args)
    if catalog is None:
        return 2
    plan = plan_ops(catalog, args.custom_ops)
    if plan is None:
        return 2
    rows = [_row_dict(row) for row in catalog.rows()]
    mark_op_rows(rows, plan)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("No plugins installed.")
    for group in GROUPS:
        group_rows = [r for r in rows if r["group"] == group]
        if not group_rows:
            continue
        print(f"{group}  (loaded in: {', '.join(GROUPS[group].processes)})")
        for r in group_rows:
            status = "allowed" if r["allowed"] else "skipped"
            print(f"  {r['name']:<28} {r['value']:<52} {r['distribution']} {r['version']}"
                  f"  [{status}: {r['reason']}]{_status(r)}")
    print_models(catalog, args.model_impl)
    print_ops(plan)
    return 0


def _matches(row: CatalogRow, name: str) -> bool:
    entry = row.entry
    return name in (entry.name, f"{entry.group}:{entry.name}", entry.distribution)


def _options_schema(obj: Any) -> dict[str, Any]:
    """``{option: {type, default, description}}`` of a plugin class's ``Options`` model."""
    model = getattr(obj, "Options", None)
    if not isinstance(obj, type) or model is None:
        return {}
    schema = model.model_json_schema()
    return {name: {k: v for k, v in prop.items() if k in ("type", "default", "description")}
            for name, prop in schema.get("properties", {}).items()}


def run_check(args: argparse.Namespace) -> int:
    """``engine plugins check [NAME]``."""
    catalog = _catalog(args)
    if catalog is None:
        return 2
    rows = catalog.rows()
    if args.name is not None:
        rows = [row for row in rows if _matches(row, args.name)]
        if not rows:
            print(f"error: no installed plugin matches {args.name!r}; see `engine plugins list`",
                  file=sys.stderr)
            return 2
    else:
        rows = [row for row in rows if row.decision.allowed]
    results = [_check_row(row) for row in rows]
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(f"engine-plugin-sdk {SDK_VERSION} (contract v{SDK_MAJOR})")
        for r in results:
            head = f"{r['group']}:{r['name']} ({r['distribution']} {r['version']})"
            print(f"OK    {head}" if r["ok"] else f"FAIL  {r['error']}")
            if r["sdk"] is not None:
                print(f"        {r['sdk']['summary']}")
                for text in r["sdk"]["deprecated"]:
                    print(f"        deprecated: {text}")
                for text in r["sdk"]["advice"]:
                    print(f"        advice: {text}")
            for option, spec in r["options"].items():
                print(f"        option {option}: {spec}")
        failed = sum(not r["ok"] for r in results)
        deprecated = sum(bool(r["sdk"] and r["sdk"]["deprecated"]) for r in results)
        print(f"{len(results) - failed} ok, {failed} failed"
              + (f", {deprecated} using deprecated SDK features" if deprecated else ""))
    return 1 if any(not r["ok"] for r in results) else 0


def _sdk_dict(compat: Compatibility) -> dict[str, Any]:
    return {"requirement": compat.requirement, "sdk_version": compat.sdk_version,
            "running": compat.running_sdk, "summary": compat.describe(),
            "deprecated": list(compat.deprecated), "advice": list(compat.advice)}


def _check_row(row: CatalogRow) -> dict[str, Any]:
    """Load and validate one entry: its result as ``engine plugins check --json`` shows it."""
    entry = row.entry
    error = None
    sdk: dict[str, Any] | None = None
    options: dict[str, dict[str, Any]] = {}
    try:
        obj, compat = load_and_check(entry, load_entry)
        sdk = _sdk_dict(compat)
        options = _options_schema(obj)
    except PluginError as exc:
        error = str(exc)
    except Exception as exc:  # noqa: BLE001 - an options model that cannot describe itself
        error = f"its Options model is invalid: {type(exc).__name__}: {exc}"
    return {
        "group": entry.group, "name": entry.name, "distribution": entry.distribution,
        "version": entry.version, "allowed": row.decision.allowed,
        "ok": error is None, "error": error, "options": options, "sdk": sdk,
    }
