"""The SDK's public API as a plain snapshot: extracted from source, stored as JSON, compared.

A snapshot maps every public path of ``engine.sdk`` to a small record. Public means what a
plugin can import or touch without a leading underscore: ``engine.sdk`` and its non-private
submodules; in a module, the names of its ``__all__`` or, without one, the names it defines;
in a class, its public members (inherited ones from SDK bases included) and the dunders a
caller relies on (:data:`KEPT_DUNDERS`).

Each object is recorded once, at its *home* (the most specific public path naming it, e.g.
``engine.sdk.scheduler.SchedulerInterface``); every other public path naming it is an
``alias`` record pointing there. Records hold kinds, signatures, annotations (names rendered
as their public home paths, so moving a class between private modules changes nothing),
literal values, class facts (bases, abstract methods, dataclass options, whether plugins
subclass it), ``versionadded`` / ``versionchanged`` notes and deprecation markers. Nothing
is imported: griffe reads the source (torch is never loaded).

The file format is JSON with one object per line, so a release's API diff reads well.
"""

from __future__ import annotations

import ast
import json
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import griffe

FORMAT = 1
PACKAGE = "engine.sdk"

#: Dunder methods that callers rely on; every other dunder is an implementation detail.
KEPT_DUNDERS = frozenset({
    "__init__", "__call__", "__iter__", "__len__", "__getitem__", "__contains__", "__bool__",
    "__enter__", "__exit__", "__aenter__", "__aexit__", "__eq__", "__hash__",
})
#: Names whose value changes with every release by design.
UNVERSIONED = frozenset({"__version__"})
#: Bases that make a class one plugins subclass (its methods are hooks the engine calls).
EXTENSIBLE_BASES = frozenset({"abc.ABC", "engine.sdk.plugin.Plugin"})
DEPRECATION_MODULE = "engine.sdk.deprecation"
_MARKERS = {f"{DEPRECATION_MODULE}.{n}": n for n in (
    "deprecated", "deprecated_hook", "deprecated_argument")}

_NOTE = re.compile(
    r"\.\.\s+(versionadded|versionchanged|deprecated)::\s*(\d+\.\d+(?:\.\d+)?)"
    r"((?:[^\n]*)(?:\n(?![ \t]*\n)(?![ \t]*\.\.)[^\n]*)*)")


class ExtractionError(Exception):
    """The source cannot be read into a snapshot (e.g. a marker with non-literal arguments)."""


@dataclass
class Snapshot:
    """The public API of one SDK version: public path -> record."""

    version: str
    objects: dict[str, dict[str, Any]]

    def dumps(self) -> str:
        """JSON text, one object per line, sorted by path."""
        head = json.dumps({"format": FORMAT, "package": PACKAGE, "version": self.version})
        lines = [f"{json.dumps(path)}: {json.dumps(self.objects[path], sort_keys=True)}"
                 for path in sorted(self.objects)]
        return head[:-1] + ', "objects": {\n' + ",\n".join(lines) + "\n}}\n"

    @classmethod
    def loads(cls, text: str) -> Snapshot:
        """Parse what :meth:`dumps` wrote."""
        data = json.loads(text)
        if data.get("format") != FORMAT:
            raise ExtractionError(f"unknown snapshot format {data.get('format')!r}")
        return cls(data["version"], data["objects"])

    @classmethod
    def load(cls, path: Path) -> Snapshot:
        """Read a snapshot file."""
        return cls.loads(path.read_text())

    def home(self, path: str) -> str | None:
        """The home path ``path`` names (itself unless it is an alias); None if absent."""
        seen = set()
        while path in self.objects and self.objects[path]["kind"] == "alias":
            if path in seen:
                raise ExtractionError(f"alias cycle at {path}")
            seen.add(path)
            path = self.objects[path]["target"]
        return path if path in self.objects else None

    def children(self, home: str) -> dict[str, str]:
        """Direct members of the class or module at ``home``: name -> path."""
        prefix = home + "."
        return {p[len(prefix):]: p for p in self.objects
                if p.startswith(prefix) and "." not in p[len(prefix):]}

    def deprecations(self) -> list[dict[str, str]]:
        """Every deprecation marker: target, kind, since, replacement, removed_in."""
        found = []
        for path, record in self.objects.items():
            if "deprecated" in record:
                found.append({"target": path, **record["deprecated"]})
            for arg, info in record.get("deprecated_arguments", {}).items():
                found.append({"target": f"{path}({arg})", **info})
        return sorted(found, key=lambda d: d["target"])


def notes_of(docstring: str | None) -> list[list[str]]:
    """``[[directive, version, text], ...]`` of the ``.. versionadded::``-style notes."""
    if not docstring:
        return []
    return [[m.group(1), m.group(2), " ".join(m.group(3).split())]
            for m in _NOTE.finditer(docstring)]


def _literal_kwargs(expr: Any, where: str) -> tuple[list[Any], dict[str, Any]]:
    """Positional and keyword arguments of a call expression, which must all be literals."""
    try:
        call = ast.parse(str(expr), mode="eval").body
        if not isinstance(call, ast.Call):
            raise ValueError("not a call")
        args = [ast.literal_eval(a) for a in call.args]
        kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg}
    except (SyntaxError, ValueError) as exc:
        raise ExtractionError(
            f"{where}: write deprecation markers with literal arguments, e.g. "
            f"@deprecated(since='1.3', replacement='new_name'), so the API tools can read "
            f"them ({exc})") from None
    return args, kwargs


def _deprecation_info(kind: str, kwargs: dict[str, Any], where: str) -> dict[str, str]:
    since = str(kwargs.get("since", ""))
    if not re.fullmatch(r"\d+\.\d+", since):
        raise ExtractionError(f"{where}: since must be 'MAJOR.MINOR', got {since!r}")
    removed = kwargs.get("removed_in") or f"{int(since.split('.')[0]) + 1}.0"
    return {"kind": kind, "since": since, "replacement": str(kwargs.get("replacement", "")),
            "removed_in": str(removed)}


class _Extractor:
    """One pass over a loaded package; see the module docstring."""

    def __init__(self, package: griffe.Module) -> None:
        self.package = package
        self.public: dict[str, griffe.Object] = {}
        self.external: dict[str, str] = {}
        self.home_of: dict[str, str] = {}
        self.objects: dict[str, dict[str, Any]] = {}

    # -- what is public ----------------------------------------------------------------------

    def _target(self, obj: Any) -> Any:
        try:
            return obj.final_target if obj.is_alias else obj
        except (griffe.AliasResolutionError, griffe.CyclicAliasError):
            return None

    def walk_module(self, module: griffe.Module, path: str) -> None:
        self.public[path] = module
        for name, member in module.members.items():
            target = self._target(member)
            sub = f"{path}.{name}"
            if target is not None and target.is_module and not member.is_alias:
                if not name.startswith("_"):
                    self.walk_module(target, sub)
                continue
            if not member.is_public or (name.startswith("_") and name not in UNVERSIONED):
                continue
            if target is None:
                self.external[sub] = str(getattr(member, "target_path", sub))
            else:
                self.public[sub] = target

    def choose_homes(self) -> None:
        by_target: dict[str, list[str]] = defaultdict(list)
        for path, obj in self.public.items():
            by_target[obj.path].append(path)
        for canonical, paths in by_target.items():
            home = canonical if canonical in paths else sorted(
                paths, key=lambda p: (-p.count("."), p))[0]
            self.home_of[canonical] = home

    # -- rendering -----------------------------------------------------------------------------

    def render(self, expr: Any) -> str | None:
        """An annotation or default as text, names spelled as their public homes."""
        if expr is None or isinstance(expr, str):
            return expr
        if isinstance(expr, griffe.ExprAttribute):
            expr = expr.last
        if isinstance(expr, griffe.ExprName):
            canonical = expr.canonical_path or expr.name
            if canonical in self.home_of:
                return self.home_of[canonical]
            if canonical.startswith(PACKAGE + ".") and "._" in canonical:
                return expr.name  # a private helper (e.g. a TypeVar): its location is no API
            return canonical
        return "".join(self.render(part) or "" for part in expr.iterate(flat=False))

    def value_of(self, name: str, value: Any) -> str | None:
        """An attribute's value when it is a literal or a dotted name; None otherwise."""
        if value is None or name in UNVERSIONED:
            return None
        text = self.render(value) or ""
        try:
            ast.literal_eval(text)
            return text
        except (ValueError, SyntaxError):
            pass
        return text if re.fullmatch(r"[A-Za-z_][\w.]*", text) else None

    # -- records -------------------------------------------------------------------------------

    def _is_extensible(self, cls: griffe.Class, depth: int = 0) -> bool:
        if depth > 20:
            return False
        if any(getattr(b, "canonical_path", str(b)) in EXTENSIBLE_BASES for b in cls.bases):
            return True
        return any(isinstance(base, griffe.Class) and self._is_extensible(base, depth + 1)
                   for base in cls.resolved_bases)

    def _markers(self, obj: Any, where: str) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        for decorator in getattr(obj, "decorators", ()):
            marker = _MARKERS.get(decorator.callable_path)
            if marker is None:
                continue
            args, kwargs = _literal_kwargs(decorator.value, where)
            if marker == "deprecated_argument":
                extra.setdefault("deprecated_arguments", {})[str(args[0])] = _deprecation_info(
                    "argument", kwargs, where)
            else:
                kind = "hook" if marker == "deprecated_hook" else (
                    "class" if obj.is_class else "method" if obj.parent.is_class else "function")
                extra["deprecated"] = _deprecation_info(kind, kwargs, where)
        return extra

    def function(self, func: griffe.Function, *, hook: bool) -> dict[str, Any]:
        params = list(func.parameters)
        is_method = func.parent is not None and func.parent.is_class
        if is_method and "staticmethod" not in func.labels and params:
            params = params[1:]
        labels = set(func.labels)
        labels |= {"final" for d in func.decorators if d.callable_path in (
            "typing.final", "typing_extensions.final")}
        record: dict[str, Any] = {
            "kind": "function",
            "parameters": [[p.name, p.kind.value, self.render(p.annotation),
                            self.render(p.default)] for p in params],
            "returns": self.render(func.returns),
            "labels": sorted(labels),
            "hook": hook and "final" not in labels,
        }
        if func.lineno == 0:
            record["synthesized"] = True
        return record

    def attribute(self, attr: griffe.Attribute, name: str) -> dict[str, Any]:
        return {"kind": "attribute", "annotation": self.render(attr.annotation),
                "value": self.value_of(name, attr.value), "labels": sorted(attr.labels)}

    def klass(self, cls: griffe.Class) -> dict[str, Any]:
        abstract = sorted(
            name for name, member in cls.all_members.items()
            if (t := self._target(member)) is not None and "abstractmethod" in t.labels)
        record: dict[str, Any] = {
            "kind": "class",
            "bases": [self.render(b) for b in cls.bases],
            "abstract_methods": abstract,
            "extensible": self._is_extensible(cls),
        }
        for decorator in cls.decorators:
            if decorator.callable_path == "dataclasses.dataclass":
                _, kwargs = (_literal_kwargs(decorator.value, cls.path)
                             if "(" in str(decorator.value) else ([], {}))
                record["dataclass"] = {k: bool(kwargs.get(k, False))
                                       for k in ("frozen", "kw_only")}
        return record

    def describe(self, path: str, obj: Any, *, hook: bool = False, depth: int = 0) -> None:
        where = f"{obj.filepath}:{obj.lineno}" if not obj.is_module else str(obj.filepath)
        if obj.is_module:
            record: dict[str, Any] = {"kind": "module"}
            self._module_getattr(path, obj)
        elif obj.is_class:
            record = self.klass(obj)
        elif obj.is_function:
            record = self.function(obj, hook=hook)
        else:
            record = self.attribute(obj, path.rsplit(".", 1)[-1])
        record.update(self._markers(obj, where))
        notes = notes_of(obj.docstring.value if obj.docstring else None)
        if notes:
            record["notes"] = notes
        self.objects[path] = record
        if obj.is_class and depth < 5:
            extensible = record["extensible"]
            for name, member in obj.all_members.items():
                if name.startswith("_") and name not in KEPT_DUNDERS:
                    continue
                target = self._target(member)
                if target is None or not target.path.startswith(PACKAGE + "."):
                    continue
                self.describe(f"{path}.{name}", target, hook=extensible, depth=depth + 1)

    def _module_getattr(self, path: str, module: griffe.Module) -> None:
        """Deprecated module names served by ``__getattr__ = module_getattr(...)``."""
        getattr_ = module.members.get("__getattr__")
        value = getattr(getattr_, "value", None) if getattr_ is not None else None
        function = getattr(value, "function", None)
        if value is None or getattr(function, "canonical_path", None) != \
                f"{DEPRECATION_MODULE}.module_getattr":
            return
        for argument in value.arguments:
            alias = getattr(argument, "value", None)
            if not hasattr(argument, "name") or alias is None:
                continue
            where = f"{module.filepath}: {argument.name}"
            if not alias.arguments:
                raise ExtractionError(f"{where}: deprecated_alias needs the aliased object")
            _, kwargs = _literal_kwargs(
                str(alias).replace(str(alias.arguments[0]), "None", 1), where)
            self.objects[f"{path}.{argument.name}"] = {
                "kind": "alias", "target": self.render(alias.arguments[0]),
                "deprecated": _deprecation_info("name", kwargs, where)}

    def run(self) -> dict[str, dict[str, Any]]:
        self.walk_module(self.package, PACKAGE)
        self.choose_homes()
        for path, obj in sorted(self.public.items()):
            home = self.home_of[obj.path]
            if path != home:
                self.objects[path] = {"kind": "alias", "target": home}
            elif path not in self.objects:
                self.describe(path, obj)
        for path, target in self.external.items():
            self.objects[path] = {"kind": "alias", "target": target, "external": True}
        return self.objects


def extract(sdk_src: Path, version: str) -> Snapshot:
    """The snapshot of the SDK whose sources are under ``sdk_src`` (``.../src``)."""
    if not (sdk_src / "engine" / "sdk" / "__init__.py").is_file():
        raise ExtractionError(f"no engine/sdk package under {sdk_src}")
    package = griffe.load(PACKAGE, search_paths=[str(sdk_src)], resolve_aliases=True,
                          resolve_external=False, allow_inspection=False)
    if not isinstance(package, griffe.Module) or package.filepath is None or \
            Path(str(package.filepath)).resolve().parents[2] != sdk_src.resolve():
        raise ExtractionError(f"griffe loaded {PACKAGE} from elsewhere than {sdk_src}")
    return Snapshot(version, _Extractor(package).run())
