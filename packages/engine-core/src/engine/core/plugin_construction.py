"""Building a plugin instance: validate its options, call its constructor, name it on failure."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from engine.core.plugin_options import validated_options
from engine.core.startup import EngineSetup
from engine.sdk.groups import LOGITS_PROCESSORS
from engine.sdk.logits_processor import LogitsProcessor
from engine.sdk.plugin import Plugin, PluginOptions

T = TypeVar("T")


def construct_plugin(setup: EngineSetup, group: str, name: str, cls: type[Plugin],
                     make: Callable[[PluginOptions], T]) -> T:
    """Validate the plugin's ``--plugin-option`` values and build it with ``make(options)``.

    Raises:
        PluginError: the options are invalid (see
            :func:`~engine.core.plugin_options.validated_options`) or the constructor
            raised, naming the plugin and its distribution.
    """
    options = validated_options(setup.catalog, group, name, cls, setup.config.plugin_options)
    try:
        return make(options)
    except Exception as exc:
        raise setup.catalog.error(
            group, name, f"constructing it failed: {type(exc).__name__}: {exc}") from exc


def logits_processor_classes(setup: EngineSetup) -> dict[str, type[LogitsProcessor]]:
    """Every installed (allowed) logits processor plus the ones given by ``module:Class``.

    The front end validates requests with them (``validate_params``); rank 0's worker
    applies them.
    """
    classes: dict[str, type[LogitsProcessor]] = dict(setup.catalog.load_group(LOGITS_PROCESSORS))
    for path in setup.config.logits_processors:
        classes[path] = setup.catalog.load(LOGITS_PROCESSORS, path)
    return classes
