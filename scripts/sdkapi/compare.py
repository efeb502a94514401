"""Compare two API snapshots: what breaks plugins, and what was added.

The rules are those of docs/plugins/versioning.md. Two directions matter:

* code a plugin *calls* (functions, constructors, helpers): removing or renaming anything,
  moving a positional parameter, making one keyword-only, removing a default, changing a
  type, a default or a constant's value breaks callers; an optional parameter is an
  addition;
* code a plugin *overrides* (methods of classes plugins subclass, i.e. SDK ABCs and
  ``Plugin`` classes, unless ``@final``): the engine is the caller, so a hook's signature
  must not grow at all (a new optional parameter would be passed to implementations that
  do not accept it), and a new abstract method breaks every existing subclass. Grow the
  context object instead, or add a new method with a default implementation.

Dataclass facts are checked too: a new field without a default (through ``__init__``),
``kw_only`` turned on, ``frozen`` turned on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from sdkapi.snapshot import Snapshot

POSITIONAL = ("positional-only", "positional or keyword")
VARIADIC = ("variadic positional", "variadic keyword")
_FLAG_LABELS = ("classmethod", "staticmethod", "property", "async")


@dataclass(frozen=True)
class Change:
    """One difference between two snapshots.

    Attributes:
        kind: ``break`` (breaks plugins), ``addition`` (new API), ``deprecation`` (a new
            deprecation marker).
        path: The public path concerned (for a member or parameter, its owner's path plus
            the member name).
        message: What changed, for humans.
        owner: For a new member or parameter of an existing object: that object's path (its
            docstring may carry the ``versionchanged`` note).
        name: The new member's or parameter's name.
        needs_note: Whether a ``versionadded`` / ``versionchanged`` note is required.
        was_deprecated: For a removal: whether the old snapshot marked it deprecated.
    """

    kind: Literal["break", "addition", "deprecation"]
    path: str
    message: str
    owner: str | None = None
    name: str | None = None
    needs_note: bool = True
    was_deprecated: bool = False


def _parent(snapshot: Snapshot, path: str) -> dict[str, Any] | None:
    head = path.rsplit(".", 1)[0]
    return snapshot.objects.get(head) if "." in path else None


def _is_top_level(snapshot: Snapshot, path: str) -> bool:
    parent = _parent(snapshot, path)
    return parent is None or parent["kind"] == "module"


def _deprecated(record: dict[str, Any] | None) -> bool:
    return bool(record and "deprecated" in record)


class _Comparison:
    def __init__(self, old: Snapshot, new: Snapshot) -> None:
        self.old, self.new = old, new
        self.changes: list[Change] = []
        self.done: set[tuple[str, str]] = set()

    def brk(self, path: str, message: str, *, was_deprecated: bool = False) -> None:
        self.changes.append(Change("break", path, message, was_deprecated=was_deprecated))

    def add(self, path: str, message: str, **kwargs: Any) -> None:
        self.changes.append(Change("addition", path, message, **kwargs))

    # -- objects -------------------------------------------------------------------------------

    def objects(self, o: str, n: str) -> None:
        if (o, n) in self.done:
            return
        self.done.add((o, n))
        ro, rn = self.old.objects[o], self.new.objects[n]
        if ro["kind"] != rn["kind"]:
            self.brk(o, f"was a {ro['kind']}, is now a {rn['kind']}")
            return
        if ro["kind"] == "function":
            self.function(o, ro, rn)
        elif ro["kind"] == "attribute":
            self.attribute(o, ro, rn)
        elif ro["kind"] == "class":
            self.klass(o, n, ro, rn)
        elif ro["kind"] == "alias" and ro.get("external"):
            if ro["target"] != rn["target"]:
                self.brk(o, f"pointed at {ro['target']}, now at {rn['target']}")

    def attribute(self, path: str, ro: dict[str, Any], rn: dict[str, Any]) -> None:
        if ro["annotation"] is not None and ro["annotation"] != rn["annotation"]:
            self.brk(path, f"type changed from {ro['annotation']} to {rn['annotation']}")
        if ro["value"] is not None and ro["value"] != rn["value"]:
            self.brk(path, f"value changed from {ro['value']} to {rn['value'] or '(computed)'}")
        if ("property" in ro["labels"]) != ("property" in rn["labels"]):
            self.brk(path, "changed between a property and a plain attribute")

    def klass(self, o: str, n: str, ro: dict[str, Any], rn: dict[str, Any]) -> None:
        for base in ro["bases"]:
            if base not in rn["bases"]:
                self.brk(o, f"no longer subclasses {base} (isinstance checks and inherited "
                            f"members break)")
        for name in sorted(set(rn["abstract_methods"]) - set(ro["abstract_methods"])):
            self.brk(f"{o}.{name}", f"is a new abstract method of {o}: every existing subclass "
                                    f"stops loading. Give it a default implementation")
        old_dc, new_dc = ro.get("dataclass"), rn.get("dataclass")
        if old_dc and new_dc:
            if new_dc["kw_only"] and not old_dc["kw_only"]:
                self.brk(o, "dataclass became kw_only: positional construction breaks")
            if new_dc["frozen"] and not old_dc["frozen"]:
                self.brk(o, "dataclass became frozen: code assigning its fields breaks")
        elif old_dc and not new_dc:
            self.brk(o, "is no longer a dataclass")
        old_members, new_members = self.old.children(o), self.new.children(n)
        for name, path in sorted(old_members.items()):
            if name not in new_members:
                record = self.old.objects[path]
                self.brk(path, f"{record['kind']} removed from {o}",
                         was_deprecated=_deprecated(record))
            else:
                self.objects(path, new_members[name])
        for name, path in sorted(new_members.items()):
            if name not in old_members and not (
                    self.new.objects[path]["kind"] == "function"
                    and self.new.objects[path].get("synthesized")):
                self.add(path, f"new {self.new.objects[path]['kind']} of {o}", owner=n, name=name)

    # -- signatures ----------------------------------------------------------------------------

    def function(self, path: str, ro: dict[str, Any], rn: dict[str, Any]) -> None:
        for label in _FLAG_LABELS:
            if (label in ro["labels"]) != (label in rn["labels"]):
                now = "is now" if label in rn["labels"] else "is no longer"
                self.brk(path, f"{now} {'an' if label == 'async' else 'a'} {label}")
        if ro["returns"] is not None and ro["returns"] != rn["returns"]:
            self.brk(path, f"return type changed from {ro['returns']} to {rn['returns']}")
        field = "field" if rn.get("synthesized") else "parameter"
        deprecated_args = ro.get("deprecated_arguments", {})
        old_params = {p[0]: (i, p) for i, p in enumerate(ro["parameters"])}
        new_params = {p[0]: (i, p) for i, p in enumerate(rn["parameters"])}
        old_positional = [p[0] for p in ro["parameters"] if p[1] in POSITIONAL]
        new_positional = [p[0] for p in rn["parameters"] if p[1] in POSITIONAL]
        for name, (_, (_, kind, annotation, default)) in old_params.items():
            if kind in VARIADIC:
                if not any(p[1] == kind for p in rn["parameters"]):
                    self.brk(path, f"no longer accepts {'*' if 'positional' in kind else '**'}"
                                   f"{name}")
                continue
            if name not in new_params:
                self.brk(f"{path}({name})", f"{field} {name!r} removed",
                         was_deprecated=name in deprecated_args)
                continue
            _, (_, new_kind, new_annotation, new_default) = new_params[name]
            if kind in POSITIONAL and new_kind in POSITIONAL and \
                    old_positional.index(name) != new_positional.index(name):
                self.brk(path, f"positional {field} {name!r} moved from position "
                               f"{old_positional.index(name) + 1} to "
                               f"{new_positional.index(name) + 1}")
            if kind != new_kind and not (new_kind == "positional or keyword" and kind in (
                    "positional-only", "keyword-only")):
                self.brk(path, f"{field} {name!r} changed from {kind} to {new_kind}")
            if default is not None and new_default is None:
                self.brk(path, f"{field} {name!r} lost its default: it is now required")
            elif default is not None and default != new_default:
                self.brk(path, f"{field} {name!r} default changed from {default} to "
                               f"{new_default}")
            if annotation is not None and annotation != new_annotation:
                self.brk(path, f"{field} {name!r} type changed from {annotation} to "
                               f"{new_annotation} (if this only widens what is accepted, "
                               f"allowlist it with that reason)")
        for name, (_, (_, kind, _, default)) in new_params.items():
            if name in old_params:
                continue
            if ro["hook"]:
                self.brk(path, f"hook gained a {field} {name!r}: the engine would pass it to "
                               f"plugins whose overrides do not accept it. Hook signatures do "
                               f"not grow: add a field to the context object, or a new method "
                               f"with a default implementation (a helper plugins never "
                               f"override: mark it @typing.final)")
            elif default is None and kind not in VARIADIC:
                what = (f"dataclass field {name!r} added without a default" if field == "field"
                        else f"new required parameter {name!r}")
                self.brk(path, f"{what}: existing calls break")
            elif field == "parameter":
                self.add(f"{path}({name})", f"new parameter {name!r} of {path}",
                         owner=path, name=name)

    # -- the whole API ---------------------------------------------------------------------

    def run(self) -> list[Change]:
        for path in sorted(self.old.objects):
            if not _is_top_level(self.old, path):
                continue
            record = self.old.objects[path]
            if path not in self.new.objects:
                self.brk(path, f"{record['kind']} removed",
                         was_deprecated=_deprecated(record) or _deprecated(
                             self.old.objects.get(self.old.home(path) or "")))
                continue
            o, n = self.old.home(path), self.new.home(path)
            if o is None or n is None:
                continue
            self.objects(o, n)
        for path in sorted(self.new.objects):
            if path in self.old.objects or not _is_top_level(self.new, path):
                continue
            record = self.new.objects[path]
            home = self.new.home(path)
            if record["kind"] == "alias":
                self.add(path, f"new name for {home or record['target']}", needs_note=False)
            else:
                self.add(path, f"new {record['kind']}")
        old_deps = {d["target"] for d in self.old.deprecations()}
        for dep in self.new.deprecations():
            if dep["target"] not in old_deps:
                self.changes.append(Change(
                    "deprecation", dep["target"],
                    f"deprecated since {dep['since']} (removed in {dep['removed_in']}); "
                    f"replacement: {dep['replacement']}", needs_note=False))
        return self.changes


def compare(old: Snapshot, new: Snapshot) -> list[Change]:
    """Every break, addition and new deprecation from ``old`` to ``new``."""
    return _Comparison(old, new).run()
