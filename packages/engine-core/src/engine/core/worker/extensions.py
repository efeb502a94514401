"""Worker extensions (``engine.worker_extensions``): mixins reachable by ``collective_rpc``.

``--worker-extension NAME`` (several allowed) selects extension classes; each worker's class
is built with them as extra bases, so inside an extension method ``self`` is the worker
(``rank``, ``world_size``, ``device``, ``model``, ``kv_caches``). A public method name that
clashes with a worker attribute or with another selected extension stops start-up with an
error naming both. ``collective_rpc(method, ...)`` calls the method on every worker; an
exception inside it comes back as a :class:`WorkerExtensionError` naming the extension and
its distribution, and the worker keeps serving.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.core.plugins import PluginCatalog
from engine.sdk.errors import PluginError
from engine.sdk.groups import WORKER_EXTENSIONS
from engine.sdk.worker_extension import WorkerExtension

#: What every worker offers extensions, set in its constructor (the SDK documents these).
WORKER_INSTANCE_ATTRIBUTES = frozenset({
    "rank", "world_size", "device", "model", "kv_caches", "setup", "eos_token_id", "built",
    "model_runner", "logits_processors", "num_available_blocks",
})
#: Lifecycle hooks every extension has; called by the engine, never by collective_rpc.
LIFECYCLE_HOOKS = frozenset(name for name in vars(WorkerExtension) if not name.startswith("_"))


class WorkerExtensionError(PluginError):
    """A worker-extension method raised (or a ``collective_rpc`` named no such method)."""


@dataclass(frozen=True)
class LoadedExtension:
    """One selected extension class and where it comes from."""

    name: str
    cls: type[WorkerExtension]
    distribution: str | None
    version: str | None

    @property
    def methods(self) -> tuple[str, ...]:
        """Public methods this extension adds (lifecycle hooks excluded)."""
        return extension_methods(self.cls)

    def describe(self) -> str:
        """``worker extension 'name' (distribution 1.0)``."""
        where = f" ({self.distribution} {self.version or ''})".rstrip() if (
            self.distribution) else ""
        return f"worker extension {self.name!r}{where}".replace(" )", ")")


def extension_methods(cls: type) -> tuple[str, ...]:
    """Public callables an extension class (and its own bases) define, sorted."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass in (WorkerExtension, object) or not issubclass(klass, WorkerExtension):
            continue
        for name, value in vars(klass).items():
            if name.startswith("_") or name in LIFECYCLE_HOOKS or name in ("name", "Options"):
                continue
            if callable(value) or isinstance(value, (staticmethod, classmethod)):
                names.add(name)
    return tuple(sorted(names))


def load_worker_extensions(catalog: PluginCatalog,
                           names: Sequence[str]) -> list[LoadedExtension]:
    """Import and validate the selected extensions (``--worker-extension``), in order.

    Raises:
        PluginError: an unknown name (listing the installed ones), a class that is not a
            ``WorkerExtension``, or the same extension selected twice.
    """
    loaded: list[LoadedExtension] = []
    for name in names:
        entry = catalog.resolve(WORKER_EXTENSIONS, name)
        cls = catalog.load(WORKER_EXTENSIONS, name)
        if any(item.cls is cls for item in loaded):
            raise catalog.error(WORKER_EXTENSIONS, name, "it is selected twice by "
                                "--worker-extension; name each extension once")
        loaded.append(LoadedExtension(name, cls, entry.distribution, entry.version))
    return loaded


def worker_class(base: type, extensions: Sequence[LoadedExtension]) -> type:
    """``base`` with the extensions as extra bases (``base`` itself when there are none).

    Raises:
        PluginError: an extension method clashes with a worker attribute or another
            extension's method, naming both.
    """
    if not extensions:
        return base
    reserved = {name for name in dir(base) if not name.startswith("_")}
    reserved |= WORKER_INSTANCE_ATTRIBUTES
    owners: dict[str, LoadedExtension] = {}
    for ext in extensions:
        for method in ext.methods:
            if method in reserved:
                raise PluginError(
                    f"worker extension method {method!r} clashes with the worker's own "
                    f"attribute {base.__module__}.{base.__qualname__}.{method}; rename the "
                    f"method", plugin=ext.name, group=WORKER_EXTENSIONS,
                    distribution=ext.distribution, version=ext.version)
            if method in owners:
                other = owners[method]
                raise PluginError(
                    f"worker extension method {method!r} is also defined by "
                    f"{other.describe()}; "
                    f"collective_rpc could not tell them apart: select one of them, or "
                    f"rename the method", plugin=ext.name, group=WORKER_EXTENSIONS,
                    distribution=ext.distribution, version=ext.version)
            owners[method] = ext
    names = "+".join(ext.name for ext in extensions)
    return type(f"{base.__name__}[{names}]", (base, *(ext.cls for ext in extensions)),
                {"__module__": base.__module__})


class ExtensionMethods:
    """The method table ``collective_rpc`` dispatches through on one worker."""

    def __init__(self, extensions: Sequence[LoadedExtension]) -> None:
        self.extensions = list(extensions)
        self.owner: dict[str, LoadedExtension] = {
            method: ext for ext in extensions for method in ext.methods}

    def available(self) -> str:
        """The callable methods, for error messages."""
        if not self.owner:
            return ("none: no worker extension is selected (start the engine with "
                    "--worker-extension NAME)")
        return ", ".join(f"{m} ({ext.name})" for m, ext in sorted(self.owner.items()))

    def call(self, worker: Any, method: str, args: Sequence[Any],
             kwargs: Mapping[str, Any]) -> Any:
        """``worker.method(*args, **kwargs)`` for an extension method.

        Raises:
            WorkerExtensionError: no extension defines ``method``, or the method raised
                (chained), naming the extension and its distribution.
        """
        ext = self.owner.get(method)
        if ext is None:
            raise WorkerExtensionError(
                f"no worker extension defines {method!r}; callable methods: "
                f"{self.available()}", group=WORKER_EXTENSIONS)
        try:
            return getattr(worker, method)(*args, **dict(kwargs))
        except Exception as exc:
            raise self._error(ext, f"{method}() raised {type(exc).__name__}: {exc}") from exc

    def run_hook(self, worker: Any, hook: str) -> None:
        """Run ``init_worker_extension`` / ``destroy_worker_extension`` of every extension."""
        for ext in self.extensions:
            fn = vars(ext.cls).get(hook) or getattr(ext.cls, hook)
            try:
                if inspect.isfunction(fn):
                    fn(worker)
            except Exception as exc:
                raise self._error(ext, f"{hook}() raised {type(exc).__name__}: {exc}") from exc

    @staticmethod
    def _error(ext: LoadedExtension, cause: str) -> WorkerExtensionError:
        return WorkerExtensionError(
            cause, plugin=ext.name, group=WORKER_EXTENSIONS,
            distribution=ext.distribution, version=ext.version)
