"""Contexts for building a plugin by hand in a test, with options validated as the engine does.

A plugin's constructor gets a context (``StatLoggerContext``, ``LogitsProcessorContext``,
...) whose ``options`` the engine has validated against the plugin's ``Options`` model
(from ``--plugin-option NAME.KEY=VALUE`` or ``plugin_options={NAME: {...}}``). A context
built by hand, ``StatLoggerContext()``, carries the empty base ``PluginOptions`` instead, so
the plugin under test reads no options at all. :func:`plugin_context` builds the context
the engine would::

    from engine.testing import plugin_context

    logger = StatsdLogger(plugin_context(StatsdLogger, {"port": 9125}, num_kv_blocks=64))
    assert logger.ctx.options.port == 9125

The context class and ``process`` follow from the plugin's SDK base class (the table
below); ``plugin_name`` defaults to the class's ``name`` (else its ``__qualname__``); every
other field of the context is a keyword argument (the SDK's context docstrings list them).

============================  ==========================  ========================
plugin base class             context                     ``process``
============================  ==========================  ========================
``StatLogger``                ``StatLoggerContext``       ``"frontend"``
``IOProcessor``               ``IOProcessorContext``      ``"frontend"``
``ToolParser``                ``ToolParserContext``       ``"frontend"``
``LogitsProcessor``           ``LogitsProcessorContext``  ``"worker"``
``SchedulingPolicy``          ``SchedulingPolicyContext`` ``"engine_core"``
``SchedulerInterface``        ``SchedulerContext``        ``"engine_core"``
``StructuredOutputBackend``   ``StructuredOutputContext`` ``"engine_core"``
``KVConnector``               ``KVConnectorContext``      by ``role``: ``"worker"`` or
                                                          ``"engine_core"``
============================  ==========================  ========================

.. versionadded:: 1.1
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.sdk.context import PluginContext
from engine.sdk.io_processor import IOProcessor, IOProcessorContext
from engine.sdk.kv_connector import KVConnector, KVConnectorContext, KVConnectorRole
from engine.sdk.logits_processor import LogitsProcessor, LogitsProcessorContext
from engine.sdk.plugin import Plugin, PluginOptions
from engine.sdk.scheduler import SchedulerContext, SchedulerInterface
from engine.sdk.scheduling_policy import SchedulingPolicy, SchedulingPolicyContext
from engine.sdk.stat_logger import StatLogger, StatLoggerContext
from engine.sdk.structured_output import StructuredOutputBackend, StructuredOutputContext
from engine.sdk.tool_parser import ToolParser, ToolParserContext

__all__ = ["plugin_context", "plugin_options"]

#: Plugin base class -> (its context class, the process that builds it).
_CONTEXTS: tuple[tuple[type[Plugin], type[PluginContext], str], ...] = (
    (StatLogger, StatLoggerContext, "frontend"),
    (IOProcessor, IOProcessorContext, "frontend"),
    (ToolParser, ToolParserContext, "frontend"),
    (LogitsProcessor, LogitsProcessorContext, "worker"),
    (SchedulingPolicy, SchedulingPolicyContext, "engine_core"),
    (SchedulerInterface, SchedulerContext, "engine_core"),
    (StructuredOutputBackend, StructuredOutputContext, "engine_core"),
    (KVConnector, KVConnectorContext, "engine_core"),
)


def plugin_options(cls: type[Plugin],
                   options: Mapping[str, Any] | PluginOptions | None = None) -> PluginOptions:
    """``cls``'s options, validated against ``cls.Options`` as the engine validates them.

    Args:
        cls: The plugin class (its ``Options`` model; the base accepts no options).
        options: Values by key, as ``plugin_options={NAME: {...}}`` gives them (strings
            from the command line are converted the same way), or an ``Options``
            instance, used as it is. ``None``: the defaults.

    Raises:
        pydantic.ValidationError: a value does not validate, or a key is unknown (the
            engine reports the same failure as a ``PluginError`` naming the plugin).
        TypeError: ``options`` is an options object of another model than ``cls.Options``.

    .. versionadded:: 1.1
    """
    if isinstance(options, PluginOptions):
        if not isinstance(options, cls.Options):
            raise TypeError(f"options for {cls.__qualname__} must be a "
                            f"{cls.Options.__qualname__} or a mapping, got "
                            f"{type(options).__qualname__}")
        return options
    return cls.Options(**dict(options or {}))


def plugin_context(cls: type[Plugin], options: Mapping[str, Any] | PluginOptions | None = None,
                   **fields: Any) -> Any:
    """The context the engine would construct ``cls`` with (see the module docstring).

    Args:
        cls: The plugin class under test (a subclass of one of the SDK bases above).
        options: Its options (see :func:`plugin_options`).
        **fields: The context's other fields, e.g. ``num_kv_blocks=64`` for a stat logger,
            ``vocab_size=32``, ``max_num_reqs=4`` for a logits processor, ``role=`` for a
            KV connector side. ``plugin_name`` and ``process`` may be given too.

    Returns:
        An instance of the context class of ``cls``'s base (e.g. ``StatLoggerContext``).

    Raises:
        pydantic.ValidationError: see :func:`plugin_options`.
        TypeError: ``cls`` is not a plugin class with a context in the table, or a field
            is not one of its context's.

    .. versionadded:: 1.1
    """
    found = next(((context_cls, process) for base, context_cls, process in _CONTEXTS
                  if isinstance(cls, type) and issubclass(cls, base)), None)
    if found is None:
        known = ", ".join(base.__name__ for base, _, _ in _CONTEXTS)
        raise TypeError(f"plugin_context: {cls!r} is not a subclass of a plugin base class "
                        f"whose constructor takes a context with options ({known})")
    context_cls, process = found
    if context_cls is KVConnectorContext and fields.get("role") is KVConnectorRole.WORKER:
        process = "worker"
    name = getattr(cls, "name", None)
    fields.setdefault("plugin_name", name if isinstance(name, str) and name else
                      cls.__qualname__)
    fields.setdefault("process", process)
    return context_cls(options=plugin_options(cls, options), **fields)
