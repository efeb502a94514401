"""Errors shared by the engine and plugins.

Three kinds, each mapped to one behaviour the operator sees:

* :class:`ValidationError`: a request or option is invalid. The server answers HTTP 400
  with the message; nothing else happens.
* :class:`PluginError`: a plugin could not be loaded or broke its contract. Start-up stops
  with one message naming the plugin, group, distribution, version and cause.
* :class:`UnsupportedError`: something was asked for that cannot run here (a quantization
  method on the wrong platform, an attention backend for an unsupported head size). It
  carries the reasons, one per candidate that was considered.

.. versionadded:: 1.0
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class EngineSDKError(Exception):
    """Base class of every error defined by the SDK.

    .. versionadded:: 1.0
    """


class ValidationError(EngineSDKError, ValueError):
    """Invalid input: a request parameter, a plugin option, a configuration value.

    The server turns it into an HTTP 400 whose message is ``str(error)``, so the message
    must say what was wrong and what is allowed.

    Args:
        message: What was wrong and what is allowed.
        param: The name of the offending field (e.g. ``"temperature"`` or
            ``"extra_args.my_key"``), reported to HTTP clients as ``param``.

    .. versionadded:: 1.0
    """

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class PluginError(EngineSDKError):
    """A plugin failed to load or broke its contract.

    The message always has the same shape, so operators can grep for it::

        plugin 'my_proc' (group engine.logits_processors, distribution my-dist 1.2.0): <cause>

    Args:
        cause: What went wrong, in words an operator can act on.
        plugin: The entry-point name (or ``module:Class`` path) of the plugin.
        group: The entry-point group, e.g. ``engine.logits_processors``.
        distribution: The installed distribution that provides the plugin, if known.
        version: That distribution's version, if known.

    .. versionadded:: 1.0
    """

    def __init__(
        self,
        cause: str,
        *,
        plugin: str | None = None,
        group: str | None = None,
        distribution: str | None = None,
        version: str | None = None,
    ) -> None:
        self.cause = cause
        self.plugin = plugin
        self.group = group
        self.distribution = distribution
        self.version = version
        super().__init__(self._format())

    def _format(self) -> str:
        if self.plugin is None:
            return self.cause
        where = []
        if self.group:
            where.append(f"group {self.group}")
        if self.distribution:
            dist = self.distribution if not self.version else f"{self.distribution} {self.version}"
            where.append(f"distribution {dist}")
        else:
            where.append("not from an installed distribution")
        return f"plugin {self.plugin!r} ({', '.join(where)}): {self.cause}"


@dataclass(frozen=True)
class PluginFailure:
    """A plugin raised while serving requests: why those requests ended with ``"error"``.

    The run-time counterpart of :class:`PluginError`, as data: it travels with the failed
    requests' outputs (``EngineCoreOutput.error``, ``ModelRunnerOutput.failed``) across
    process boundaries. The server answers the requests it names with HTTP 500, error type
    ``plugin_error`` and :attr:`message`; every other request is served as usual.

    Attributes:
        cause: What the plugin raised, e.g. ``"ZeroDivisionError: division by zero in
            apply()"``.
        plugin: The entry-point name (or ``module:Class`` path) of the plugin.
        group: The entry-point group, e.g. ``engine.logits_processors``.
        distribution: The installed distribution that provides the plugin, if known.
        version: That distribution's version, if known.

    .. versionadded:: 1.1
    """

    cause: str
    plugin: str | None = None
    group: str | None = None
    distribution: str | None = None
    version: str | None = None

    @property
    def message(self) -> str:
        """The operator-facing message, shaped like every :class:`PluginError` message."""
        return str(self.to_error())

    def to_error(self) -> PluginError:
        """The equivalent :class:`PluginError` (to raise it)."""
        return PluginError(self.cause, plugin=self.plugin, group=self.group,
                           distribution=self.distribution, version=self.version)

    @classmethod
    def from_error(cls, error: PluginError) -> PluginFailure:
        """The failure a :class:`PluginError` describes."""
        return cls(error.cause, plugin=error.plugin, group=error.group,
                   distribution=error.distribution, version=error.version)


class UnsupportedError(EngineSDKError):
    """A requested feature cannot run here; carries the reason of each candidate.

    Args:
        message: One line saying what was asked for.
        reasons: ``(candidate, reason)`` pairs, e.g. ``[("triton_fp8", "needs compute
            capability >= 8.9, found 8.0")]``. They are appended to the message, one per line.

    .. versionadded:: 1.0
    """

    def __init__(self, message: str, reasons: Sequence[tuple[str, str]] = ()) -> None:
        self.reasons = tuple(reasons)
        lines = [message] + [f"  - {name}: {reason}" for name, reason in self.reasons]
        super().__init__("\n".join(lines))
