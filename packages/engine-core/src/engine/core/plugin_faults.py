"""Run-time plugin failures inside the forward pass: name the plugin, fail its step only.

A plugin called from the model's forward pass serves every request of the step. When it
raises, the worker cannot tell which requests it concerned, so the exception becomes a
``PluginError`` naming the plugin, its group and distribution; the model runner catches
that and fails every request of the step (``ModelRunnerOutput.failed``), and the engine
serves on. Two ways to name the plugin:

* guarded calls: custom-op replacements (:func:`guard_forward`) and a KV connector's hooks
  (``engine.core.worker.kv_connector``) raise the ``PluginError`` themselves;
* any other exception of the forward pass is attributed by its traceback
  (:class:`ForwardAttribution`): the innermost frame in the module of an installed model,
  attention backend, linear kernel, quantization method or custom op names it.

An exception no plugin can be named for is an engine bug and still stops the engine.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

from engine.core.plugins import PluginCatalog, PluginEntry
from engine.core.plugins._loader import plugin_error
from engine.sdk.errors import PluginError
from engine.sdk.groups import (
    ATTENTION_BACKENDS,
    CUSTOM_OPS,
    LINEAR_KERNELS,
    MODELS,
    QUANTIZATION,
)

T = TypeVar("T", bound=type)


def describe(cause: BaseException | str) -> str:
    """``"ZeroDivisionError: division by zero"`` for an exception; a message as it is."""
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}"
    return cause


R = TypeVar("R")


def call_plugin(hook: str, fn: Callable[..., R], *args: Any,
                error: Callable[[str], PluginError],
                passes: tuple[type[Exception], ...] = (PluginError,)) -> R:
    """``fn(*args)``; any exception but those in ``passes`` becomes ``error("HOOK raised ...")``.

    ``passes`` is ``PluginError`` by default; hooks whose ``ValidationError`` is the
    client's (a 400) add it.
    """
    try:
        return fn(*args)
    except passes:
        raise
    except Exception as exc:
        raise error(f"{hook} raised {describe(exc)}") from exc


def guard_forward(cls: T, error: Callable[[str], PluginError]) -> T:
    """A subclass of the plugin class ``cls`` whose ``forward`` names the plugin on failure.

    Args:
        cls: A plugin's ``nn.Module`` class (e.g. a custom-op replacement).
        error: Builds the ``PluginError`` naming the plugin from a cause.

    Returns:
        The subclass (same name, module and qualified name), or ``cls`` itself when it
        is already guarded.
    """
    if getattr(cls, "_engine_guarded", False):
        return cls
    inner: Callable[..., Any] = getattr(cls, "forward")  # noqa: B009 - T is any class

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return inner(self, *args, **kwargs)
        except PluginError as exc:
            if exc.plugin is not None:
                raise
            raise error(f"forward raised {describe(exc)}") from exc
        except Exception as exc:
            raise error(f"forward raised {describe(exc)}") from exc

    namespace = {"forward": forward, "_engine_guarded": True, "__module__": cls.__module__,
                 "__qualname__": cls.__qualname__, "__doc__": cls.__doc__}
    return type(cls.__name__, (cls,), namespace)  # type: ignore[return-value]


#: The groups whose plugins run inside the model's forward pass.
FORWARD_GROUPS = (MODELS, ATTENTION_BACKENDS, LINEAR_KERNELS, QUANTIZATION, CUSTOM_OPS)


class ForwardAttribution:
    """Names the plugin whose code raised an exception in the forward pass.

    Args:
        catalog: The process's plugin catalog; its allowed third-party entries of
            :data:`FORWARD_GROUPS` are the candidates (the engine's own are not: an
            exception there is an engine bug).
    """

    def __init__(self, catalog: PluginCatalog) -> None:
        self._by_module: dict[str, PluginEntry] = {}
        # every package an entry's module is in -> the first such entry; looked up by a
        # frame's root package (:func:`root_package`), never by a shared namespace
        self._by_package: dict[str, PluginEntry] = {}
        self._by_value: dict[str, PluginEntry] = {}  # "module:Class" -> its entry
        for group in FORWARD_GROUPS:
            for entry in catalog.allowed(group):
                if not entry.is_builtin:
                    module = entry.value.partition(":")[0]
                    self._by_value.setdefault(entry.value, entry)
                    self._by_module.setdefault(module, entry)
                    parts = module.split(".")
                    for end in range(1, len(parts)):
                        self._by_package.setdefault(".".join(parts[:end]), entry)

    def plugin_of(self, exc: BaseException) -> PluginEntry | None:
        """The entry whose module (or a submodule's package) holds the innermost frame."""
        if not self._by_module:
            return None
        found = None
        tb: TracebackType | None = exc.__traceback__
        while tb is not None:
            entry = self._entry_of(str(tb.tb_frame.f_globals.get("__name__", "")))
            found = entry or found
            tb = tb.tb_next
        return found

    def plugin_of_class(self, cls: type) -> PluginEntry | None:
        """The entry of ``cls`` itself, else the first of the module (or a parent) defining it.

        Only a module's own entries: a class of the PEP 420 namespace the engine's
        distributions share (``engine.*``) is not attributed by its top-level package.
        """
        entry = self._by_value.get(f"{cls.__module__}:{cls.__qualname__}")
        name = cls.__module__
        while entry is None and name:
            entry = self._by_module.get(name)
            name = name.rpartition(".")[0]
        return entry

    def error(self, exc: BaseException) -> PluginError | None:
        """The ``PluginError`` for ``exc``, or None when no plugin raised it."""
        entry = self.plugin_of(exc)
        if entry is None:
            return None
        return plugin_error(entry, f"raised {describe(exc)} in the forward pass")

    def _entry_of(self, module: str) -> PluginEntry | None:
        name = module
        while name:
            entry = self._by_module.get(name)
            if entry is not None:
                return entry
            name = name.rpartition(".")[0]
        return self._by_package.get(root_package(module))


def root_package(module: str) -> str:
    """The outermost package of loaded ``module`` that is not a namespace package.

    ``acme_plugins.kernels.util`` -> ``acme_plugins``; ``engine.kernels.triton`` ->
    ``engine.kernels``: ``engine`` is the PEP 420 namespace the engine's distributions (and
    any plugin that chooses it) share, so it names none of them. A module not loaded
    (not in ``sys.modules``) counts as a regular package.
    """
    parts = module.split(".")
    for end in range(1, len(parts) + 1):
        name = ".".join(parts[:end])
        loaded = sys.modules.get(name)
        if loaded is None or getattr(loaded, "__file__", None) is not None:
            return name
    return module
