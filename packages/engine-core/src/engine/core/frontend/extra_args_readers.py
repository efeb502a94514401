"""The plugins whose ``extra_args`` keys a request may use, named as messages name them.

Every plugin this engine uses that sees requests may take keys (``Plugin.extra_args_keys``,
SDK 1.1): every loaded logits processor, and the selected scheduler, scheduling policy and
KV connector (they see ``request.sampling_params``), structured-outputs backend and IO
processor (the front end's own request-facing plugins). Worker extensions, models and the
other worker-side plugins never see a request's parameters, so they take no keys. The
classes are imported here, in the front end, at start-up: they are known then, and a
selection that cannot be loaded stops start-up here with the error EngineCore would give.
"""

from __future__ import annotations

from collections.abc import Mapping

from engine.core.startup import EngineSetup
from engine.sdk.groups import (
    IO_PROCESSORS,
    KV_CONNECTORS,
    LOGITS_PROCESSORS,
    SCHEDULERS,
    SCHEDULING_POLICIES,
    STRUCTURED_OUTPUT_BACKENDS,
)
from engine.sdk.plugin import Plugin

#: Groups with one selected plugin: (group, config field, what messages call it).
_SELECTED = (
    (SCHEDULERS, "scheduler", "scheduler"),
    (SCHEDULING_POLICIES, "scheduling_policy", "scheduling policy"),
    (KV_CONNECTORS, "kv_connector", "KV connector"),
    (STRUCTURED_OUTPUT_BACKENDS, "structured_outputs_backend", "structured-outputs backend"),
    (IO_PROCESSORS, "io_processor", "IO processor"),
)


def plugin_label(setup: EngineSetup, group: str, name: str, what: str) -> str:
    """``scheduling policy 'tiered' (acme-plugins 0.3.0)``: a plugin, as messages name it."""
    entry = setup.catalog.resolve(group, name)
    return f"{what} {name!r}" + (f" ({entry.provider})" if entry.distribution else "")


def extra_args_readers(setup: EngineSetup, logits_processors: Mapping[str, type[Plugin]],
                       ) -> dict[str, type[Plugin]]:
    """Label -> class of every plugin this engine uses that may take ``extra_args`` keys.

    Args:
        setup: The engine's resolved configuration and plugin catalog.
        logits_processors: The loaded logits processors by name (entry name or
            ``module:Class``).

    Raises:
        PluginError: a selected plugin cannot be loaded, naming it.
    """
    readers: dict[str, type[Plugin]] = {
        plugin_label(setup, LOGITS_PROCESSORS, name, "logits processor"): cls
        for name, cls in logits_processors.items()}
    for group, field, what in _SELECTED:
        name = getattr(setup.config, field)
        if name is not None:
            readers[plugin_label(setup, group, name, what)] = setup.catalog.load(group, name)
    return readers
