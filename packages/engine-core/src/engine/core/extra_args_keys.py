"""The plugins whose ``extra_args`` keys a request may use, and the keys they take.

Every plugin this engine uses that sees requests may take keys (``Plugin.extra_args_keys``,
SDK 1.1): every loaded logits processor, the selected scheduler, scheduling policy and KV
connector (they see ``request.sampling_params`` in EngineCore), and the selected
structured-outputs backend and IO processor (the front end's request-facing plugins).
Worker extensions, models and the other worker-side plugins never see a request's
parameters, so they take no keys.

Each process reads the declarations of the classes it loads anyway: the front end those of
its own plugins (:func:`front_end_plugins`); EngineCore those of its scheduler, policy and
connector (:func:`engine_core_keys`), which reach the front end in ``EngineInfo`` (the API
server never imports EngineCore's code, plugins included). The front end refuses the other
keys (:mod:`engine.core.frontend.extra_args`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from engine.sdk.groups import (
    IO_PROCESSORS,
    KV_CONNECTORS,
    LOGITS_PROCESSORS,
    SCHEDULERS,
    SCHEDULING_POLICIES,
    STRUCTURED_OUTPUT_BACKENDS,
)

if TYPE_CHECKING:
    from engine.core.startup import EngineSetup

#: (group, config field, what messages call it) of the plugins EngineCore selects.
ENGINE_CORE_SELECTIONS = (
    (SCHEDULERS, "scheduler", "scheduler"),
    (SCHEDULING_POLICIES, "scheduling_policy", "scheduling policy"),
    (KV_CONNECTORS, "kv_connector", "KV connector"),
)
#: The same for the front end's selected plugins.
FRONT_END_SELECTIONS = (
    (STRUCTURED_OUTPUT_BACKENDS, "structured_outputs_backend", "structured-outputs backend"),
    (IO_PROCESSORS, "io_processor", "IO processor"),
)


def plugin_label(setup: EngineSetup, group: str, name: str, what: str) -> str:
    """``scheduling policy 'tiered' (acme-plugins 0.3.0)``: a plugin, as messages name it."""
    entry = setup.catalog.resolve(group, name)
    return f"{what} {name!r}" + (f" ({entry.provider})" if entry.distribution else "")


def selected_plugins(setup: EngineSetup, selections: tuple[tuple[str, str, str], ...],
                     ) -> dict[str, type]:
    """Label -> class of the plugins ``selections`` names in this engine's config.

    Raises:
        PluginError: a selected plugin cannot be loaded, naming it.
    """
    plugins: dict[str, type] = {}
    for group, field, what in selections:
        name = getattr(setup.config, field)
        if name is not None:
            plugins[plugin_label(setup, group, name, what)] = setup.catalog.load(group, name)
    return plugins


def front_end_plugins(setup: EngineSetup, logits_processors: Mapping[str, type],
                      ) -> dict[str, type]:
    """Label -> class of the front end's plugins that may take keys.

    Args:
        setup: The engine's resolved configuration and plugin catalog.
        logits_processors: The loaded logits processors by name (entry name or
            ``module:Class``).
    """
    plugins = {plugin_label(setup, LOGITS_PROCESSORS, name, "logits processor"): cls
               for name, cls in logits_processors.items()}
    plugins.update(selected_plugins(setup, FRONT_END_SELECTIONS))
    return plugins


def keys_taken(plugins: Mapping[str, type]) -> dict[str, tuple[str, ...]]:
    """Key -> the plugins (labels) that declare it in ``extra_args_keys``, keys sorted."""
    taken: dict[str, list[str]] = {}
    for label, cls in plugins.items():
        for key in getattr(cls, "extra_args_keys", ()):
            taken.setdefault(key, []).append(label)
    return {key: tuple(taken[key]) for key in sorted(taken)}


def engine_core_keys(setup: EngineSetup) -> dict[str, tuple[str, ...]]:
    """The keys EngineCore's selected scheduler, policy and KV connector take (``EngineInfo``)."""
    return keys_taken(selected_plugins(setup, ENGINE_CORE_SELECTIONS))
