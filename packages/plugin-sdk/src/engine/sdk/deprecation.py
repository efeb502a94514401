"""Deprecations: how the SDK retires a name, an argument or an ABC method within a major.

A deprecated feature keeps working until the next major release. Using it emits an
:class:`SDKDeprecationWarning` (a ``DeprecationWarning``) once per plugin, naming the plugin
and its distribution, and logs the same line at WARNING on the ``engine.sdk.deprecation``
logger (Python hides ``DeprecationWarning`` outside ``__main__``; operators read logs). It
is listed with its replacement in
``docs/plugins/deprecations.md``, which is generated from this module's registry (CI fails
when the page and the code disagree).

Four markers, one per kind of feature:

* :func:`deprecated` on a function, a class or a method that plugins *call*: warns on each
  call (a class: on instantiation and when subclassed).
* :func:`deprecated_hook` on an ABC method that the engine calls and plugins *override*:
  warns when a plugin class overrides it (at class creation for :class:`~engine.sdk.Plugin`
  classes, and when the engine loads the plugin). Give the ABC a new method with a default
  implementation that calls the old one, so old plugins keep working unchanged (a new
  abstract method would break them).
* :func:`deprecated_argument` on a function: warns when the argument is passed, and can
  forward it to its new name.
* :func:`deprecated_alias` with :func:`module_getattr`: a module-level name kept as an
  alias of its replacement (warns on access).

Example (what an SDK maintainer writes)::

    class StatLogger(Plugin, ABC):
        @deprecated_hook(since="1.3", replacement="record")
        def log_stats(self, stats: SchedulerStats) -> None: ...

    __getattr__ = module_getattr(
        __name__, OldName=deprecated_alias(NewName, since="1.3", replacement="NewName"))

Plugin authors: run your tests with warnings as errors (``filterwarnings = error`` in
pytest) to see every deprecation as soon as you upgrade the SDK.

.. versionadded:: 1.1
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from engine.sdk._users import caller_frame, describe_user, is_sdk_module

_T = TypeVar("_T")

DeprecationKind = Literal["function", "class", "method", "hook", "argument", "name"]
"""What kind of feature a :class:`Deprecation` retires.

.. versionadded:: 1.1
"""

_VERSION = re.compile(r"^(\d+)\.(\d+)$")
_MARK = "__engine_sdk_deprecation__"


class SDKDeprecationWarning(DeprecationWarning):
    """A plugin uses a feature of the SDK that is deprecated (removed in the next major).

    Args:
        message: Who uses what, and what to do instead.
        deprecation: The feature used (tools such as ``engine plugins check`` read it).

    .. versionadded:: 1.1
    """

    def __init__(self, message: str, deprecation: Deprecation | None = None) -> None:
        super().__init__(message)
        self.deprecation = deprecation


@dataclass(frozen=True)
class Deprecation:
    """One deprecated feature of the SDK.

    Attributes:
        target: What is deprecated, as a plugin author spells it: ``engine.sdk.mod.name``,
            ``engine.sdk.mod.Class.method``, or ``engine.sdk.mod.function(argument)``.
        kind: ``function``, ``class``, ``method`` (called by plugins), ``hook`` (overridden
            by plugins), ``argument`` or ``name`` (a module-level alias).
        since: The SDK release that deprecated it, ``"MAJOR.MINOR"``.
        replacement: What to use instead: a name (``"record"``) or a sentence.
        removed_in: The major release that removes it, ``"MAJOR.0"``.

    .. versionadded:: 1.1
    """

    target: str
    kind: DeprecationKind
    since: str
    replacement: str
    removed_in: str

    def advice(self) -> str:
        """What to do instead, as a clause (``"use record instead"``)."""
        text = self.replacement.strip()
        if " " in text:
            return text
        verb = "implement" if self.kind == "hook" else "use"
        return f"{verb} {text} instead"

    def message(self) -> str:
        """The warning text, without the plugin's name."""
        when = (f"deprecated since engine-plugin-sdk {self.since} and removed in "
                f"{self.removed_in}")
        if self.kind == "hook":
            return (f"overrides {self.target}, which is {when} (the engine stops calling it "
                    f"then); {self.advice()}")
        if self.kind == "argument":
            return f"passes the argument {self.target}, {when}; {self.advice()}"
        return f"uses {self.target}, {when}; {self.advice()}"


_logger = logging.getLogger("engine.sdk.deprecation")
_registry: dict[str, Deprecation] = {}
_warned: set[tuple[str, str]] = set()
_lock = threading.Lock()


def _minor(text: str, what: str) -> tuple[int, int]:
    match = _VERSION.match(text)
    if match is None:
        raise ValueError(f"{what} must be 'MAJOR.MINOR' (e.g. '1.3'), got {text!r}")
    return int(match.group(1)), int(match.group(2))


def _make(target: str, kind: DeprecationKind, since: str, replacement: str,
          removed_in: str | None) -> Deprecation:
    major, _ = _minor(since, "since")
    removed = removed_in or f"{major + 1}.0"
    removed_major, removed_minor = _minor(removed, "removed_in")
    if removed_major <= major or removed_minor != 0:
        raise ValueError(f"{target}: removed_in must be a later major release 'N.0' "
                         f"(removal happens only in a major release), got {removed!r}")
    if not replacement.strip():
        raise ValueError(f"{target}: a deprecation needs a replacement (what to use instead)")
    dep = Deprecation(target, kind, since, replacement, removed)
    with _lock:
        known = _registry.setdefault(target, dep)
    if known != dep:
        raise ValueError(f"{target} is deprecated twice, differently: {known} and {dep}")
    return dep


def _public_path(module: str, qualname: str) -> str:
    """``engine.sdk.mod._impl`` + ``Cls.meth`` -> ``engine.sdk.mod.Cls.meth``."""
    parts = [p for p in module.split(".") if not p.startswith("_")]
    return ".".join([*parts, qualname])


def registered() -> tuple[Deprecation, ...]:
    """Every deprecation registered by the SDK modules imported so far, by target.

    .. versionadded:: 1.1
    """
    with _lock:
        return tuple(sorted(_registry.values(), key=lambda d: d.target))


def warn_deprecated(
    deprecation: Deprecation, *, user: str | None = None, key: str | None = None,
    stacklevel: int = 2,
) -> None:
    """Warn that ``user`` uses ``deprecation``, once per user and deprecation in a process.

    Emits an :class:`SDKDeprecationWarning` and logs the same message at WARNING.

    Args:
        deprecation: What is used.
        user: Who uses it, e.g. ``"plugin 'x' (group G, distribution D 1.0)"`` (the engine
            passes its plugin's identity). By default, the plugin behind the first caller
            outside the SDK, found from installed metadata.
        stacklevel: As for :func:`warnings.warn`, counted from the caller; frames inside
            the SDK are skipped.
        key: What "once" is counted by (default: ``user``), e.g. the plugin class.

    .. versionadded:: 1.1
    """
    frame, level = caller_frame(stacklevel)
    if user is None:
        module = str(frame.f_globals.get("__name__", "?")) if frame is not None else "?"
        user = describe_user(module)
    once = (deprecation.target, key or user)
    with _lock:
        if once in _warned:
            return
        _warned.add(once)
    message = f"{user}: {deprecation.message()}"
    _logger.warning("%s", message)
    warnings.warn(SDKDeprecationWarning(message, deprecation), stacklevel=level)


def _wrap_callable(func: Callable[..., Any], dep: Deprecation) -> Callable[..., Any]:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        warn_deprecated(dep)
        return func(*args, **kwargs)

    setattr(wrapper, _MARK, dep)
    return wrapper


def _deprecate_class(cls: type, dep: Deprecation) -> type:
    original_init: Callable[..., None] = cls.__init__  # type: ignore[misc]

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        sub = type(self)
        user = None if sub is cls or is_sdk_module(sub.__module__) else describe_user(
            sub.__module__)
        warn_deprecated(dep, user=user)
        original_init(self, *args, **kwargs)

    own_hook = cls.__dict__.get("__init_subclass__")

    def __init_subclass__(sub: type, /, **kwargs: Any) -> None:
        if not is_sdk_module(sub.__module__):
            warn_deprecated(dep, user=describe_user(sub.__module__))
        if own_hook is not None:
            own_hook.__func__(sub, **kwargs)
        else:
            super(cls, sub).__init_subclass__(**kwargs)  # type: ignore[arg-type]

    setattr(cls, "__init__", __init__)  # noqa: B010 - assigning a method mypy would refuse
    setattr(cls, "__init_subclass__", classmethod(__init_subclass__))  # noqa: B010
    setattr(cls, _MARK, dep)
    return cls


def deprecated(
    *, since: str, replacement: str, removed_in: str | None = None, name: str | None = None
) -> Callable[[_T], _T]:
    """Mark a function, a class or a method that plugins call as deprecated.

    Args:
        since: The SDK release that deprecates it, ``"MAJOR.MINOR"``.
        replacement: What to use instead (a name or a sentence).
        removed_in: The major release that removes it (default: the next major).
        name: The public name to show (default: the module path without private parts
            plus the qualified name).

    Returns:
        A decorator; the decorated object keeps working and warns on each use (once per
        plugin). Apply it under ``@classmethod`` / ``@staticmethod`` for such methods.

    Raises:
        ValueError: A version is not ``"MAJOR.MINOR"``, ``removed_in`` is not a later
            major, or the replacement is empty.

    .. versionadded:: 1.1
    """
    def decorate(obj: _T) -> _T:
        qualname = getattr(obj, "__qualname__", repr(obj))
        target = name or _public_path(getattr(obj, "__module__", "?"), qualname)
        if isinstance(obj, type):
            return _deprecate_class(obj, _make(target, "class", since, replacement, removed_in))  # type: ignore[return-value]
        if not callable(obj):
            raise TypeError(f"@deprecated applies to functions, classes and methods, got {obj!r}")
        is_method = "." in qualname and "<locals>" not in qualname.rsplit(".", 1)[0]
        kind: DeprecationKind = "method" if is_method else "function"
        return _wrap_callable(obj, _make(target, kind, since, replacement, removed_in))  # type: ignore[return-value]

    return decorate


def deprecated_hook(
    *, since: str, replacement: str, removed_in: str | None = None
) -> Callable[[_T], _T]:
    """Mark an ABC method that the engine calls and plugins override as deprecated.

    The method itself is unchanged (the engine calling it on a plugin that does not
    override it warns nobody). A plugin class that overrides it gets a warning naming the
    plugin: when the class is created (:class:`~engine.sdk.Plugin` subclasses) and when
    the engine loads it. Apply it under ``@classmethod`` for class-method hooks.

    Args:
        since: The SDK release that deprecates it, ``"MAJOR.MINOR"``.
        replacement: The method (or sentence) to implement instead.
        removed_in: The major release that stops calling it (default: the next major).

    .. versionadded:: 1.1
    """
    def decorate(func: _T) -> _T:
        target = _public_path(getattr(func, "__module__", "?"), getattr(func, "__qualname__", "?"))
        setattr(func, _MARK, _make(target, "hook", since, replacement, removed_in))
        return func

    return decorate


def deprecated_argument(
    argument: str, *, since: str, replacement: str, removed_in: str | None = None,
    rename_to: str | None = None,
) -> Callable[[_T], _T]:
    """Mark one argument of a function as deprecated; warns when it is passed.

    Args:
        argument: The deprecated parameter; it stays in the signature until removal.
        since: The SDK release that deprecates it, ``"MAJOR.MINOR"``.
        replacement: What to pass instead.
        removed_in: The major release that removes it (default: the next major).
        rename_to: A parameter of the same function that takes the value instead: a value
            passed as ``argument`` is forwarded to it (passing both is a ``TypeError``).

    .. versionadded:: 1.1
    """
    def decorate(func: _T) -> _T:
        if not callable(func):
            raise TypeError(f"@deprecated_argument applies to functions, got {func!r}")
        qualname = getattr(func, "__qualname__", repr(func))
        signature = inspect.signature(func)
        for param in (argument, rename_to):
            if param is not None and param not in signature.parameters:
                raise ValueError(f"{qualname} has no parameter {param!r}")
        target = _public_path(getattr(func, "__module__", "?"), f"{qualname}({argument})")
        dep = _make(target, "argument", since, replacement, removed_in)

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind_partial(*args, **kwargs)
            if argument in bound.arguments:
                warn_deprecated(dep)
                if rename_to is not None:
                    if rename_to in bound.arguments:
                        raise TypeError(f"{qualname}() got both {argument!r} "
                                        f"(deprecated) and {rename_to!r}; pass {rename_to!r}")
                    bound.arguments[rename_to] = bound.arguments.pop(argument)
                return func(*bound.args, **bound.kwargs)
            return func(*args, **kwargs)

        setattr(wrapper, _MARK, dep)
        return wrapper  # type: ignore[return-value]

    return decorate


@dataclass(frozen=True)
class DeprecatedAlias:
    """A module-level name kept as a deprecated alias; built by :func:`deprecated_alias`.

    Attributes:
        value: The object the old name still returns (usually its replacement).
        since: The SDK release that deprecates the name.
        replacement: The name to use instead.
        removed_in: The major release that removes it (None: the next major).

    .. versionadded:: 1.1
    """

    value: Any
    since: str
    replacement: str
    removed_in: str | None = None


def deprecated_alias(
    value: Any, *, since: str, replacement: str, removed_in: str | None = None
) -> DeprecatedAlias:
    """A deprecated module-level name for ``value``; install it with :func:`module_getattr`.

    .. versionadded:: 1.1
    """
    return DeprecatedAlias(value, since, replacement, removed_in)


def module_getattr(module_name: str, **aliases: DeprecatedAlias) -> Callable[[str], Any]:
    """A module ``__getattr__`` (PEP 562) serving deprecated names, warning on access.

    Use it as ``__getattr__ = module_getattr(__name__, OldName=deprecated_alias(...))``;
    the names must not also be defined in the module.

    .. versionadded:: 1.1
    """
    deps = {
        name: _make(_public_path(module_name, name), "name", alias.since, alias.replacement,
                    alias.removed_in)
        for name, alias in aliases.items()
    }

    def __getattr__(name: str) -> Any:
        if name not in aliases:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        warn_deprecated(deps[name])
        return aliases[name].value

    return __getattr__


def _marked(attr: Any) -> Deprecation | None:
    func = attr.__func__ if isinstance(attr, (classmethod, staticmethod)) else attr
    dep = getattr(func, _MARK, None)
    return dep if isinstance(dep, Deprecation) and dep.kind == "hook" else None


def overridden_hooks(cls: type) -> tuple[Deprecation, ...]:
    """The deprecated hooks of SDK base classes that ``cls`` (or a non-SDK base) overrides.

    .. versionadded:: 1.1
    """
    found: dict[str, Deprecation] = {}
    for base in cls.__mro__[1:]:
        if not is_sdk_module(base.__module__):
            continue
        for name, attr in vars(base).items():
            dep = _marked(attr)
            if dep is None or name in found:
                continue
            owner = next(k for k in cls.__mro__ if name in vars(k))
            if not is_sdk_module(owner.__module__):
                found[name] = dep
    return tuple(found[name] for name in sorted(found))


def warn_overridden_hooks(cls: type, *, user: str | None = None) -> tuple[Deprecation, ...]:
    """Warn once per deprecated hook that ``cls`` overrides; returns them.

    Called by :class:`~engine.sdk.Plugin` at class creation and by the engine when it
    loads a plugin (with the plugin's identity as ``user``).

    .. versionadded:: 1.1
    """
    if is_sdk_module(cls.__module__):
        return ()
    hooks = overridden_hooks(cls)
    if not hooks:  # the usual case: naming the user scans every installed distribution
        return ()
    who = user or f"{describe_user(cls.__module__)}, class {cls.__qualname__}"
    for dep in hooks:
        warn_deprecated(dep, user=who, key=f"{cls.__module__}.{cls.__qualname__}")
    return hooks
