"""``PluginContext``: the narrow, frozen view of the engine a plugin receives.

No plugin receives the whole engine configuration. Each seam gets a subclass of
:class:`PluginContext` holding exactly what it needs (the logits-processor context holds the
vocabulary size and batch capacity, the attention context the head geometry, ...) plus the
plugin's own validated options. Contexts are frozen: a plugin cannot change the engine
through them. New fields are only ever added, with defaults, within a major version.

Subclasses are keyword-only dataclasses: build them with ``Ctx(plugin_name=..., ...)``.

.. versionadded:: 1.0
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sdk.plugin import PluginOptions


@dataclass(frozen=True, kw_only=True)
class PluginContext:
    """What every plugin is told about where it runs.

    Attributes:
        plugin_name: The name the plugin was selected under (entry-point name or
            ``module:Class``).
        options: The plugin's options, validated against its ``Options`` model.
        process: Which engine process constructs the plugin: ``"frontend"``,
            ``"engine_core"`` or ``"worker"``.
        model: The served model's name or path (informational).

    .. versionadded:: 1.0
    """

    plugin_name: str = ""
    options: PluginOptions = field(default_factory=PluginOptions)
    process: str = "worker"
    model: str = ""
