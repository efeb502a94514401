"""``--plugin-option`` at start-up: every target exists, and no given value goes unchecked.

A plugin's options are validated against its ``Options`` model when the engine builds the
plugin (:mod:`engine.core.plugin_construction`, the worker's model setup, the KV
connector), which only happens to the plugins the engine uses. The front end's
:func:`engine.core.startup.prepare` adds two checks so that no value is silently dropped:

1. :func:`check_option_targets` (before general plugins run): every key names one
   installed, allowed plugin (``NAME`` unique across groups, or ``GROUP:NAME``), or a
   plugin selected as ``module:Class``. A name that nothing installed provides is an error
   listing the allowed plugins; an installed plugin the allowlist skips is an error saying
   why; a plain name two groups share is an error listing the ``GROUP:NAME`` spellings.
2. :func:`check_unused_options` (once the engine's choices are known): the values of a
   plugin whose options would never be validated are validated now, against its
   ``Options``, which imports it:

   * a plugin this engine does not use (another scheduling policy than
     ``--scheduling-policy``, an IO processor while none is selected, an attention
     backend other than the one the platform picks, a model for another architecture);
   * a plugin of a group whose plugins receive no options in SDK 1.x (general plugins,
     platforms, quantization, linear kernels, custom ops, worker extensions, endpoints).

   A bad value stops start-up with a :class:`~engine.sdk.errors.PluginError` naming the
   plugin, group and distribution, what was wrong and the options it accepts. Valid
   values are accepted and logged at INFO as having no effect, with the reason.

Plugins the engine uses (and ones whose use is decided later, such as linear kernels
chosen per layer by priority) are validated where they are built, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import pydantic

from engine.core.config import EngineConfig
from engine.core.plugins import PluginCatalog, PluginEntry
from engine.core.plugins._loader import identity, plugin_error
from engine.sdk.errors import ValidationError
from engine.sdk.groups import (
    ATTENTION_BACKENDS,
    CUSTOM_OPS,
    ENDPOINTS,
    GENERAL_PLUGINS,
    IO_PROCESSORS,
    KV_CONNECTORS,
    LINEAR_KERNELS,
    MODELS,
    PLATFORMS,
    QUANTIZATION,
    SCHEDULERS,
    SCHEDULING_POLICIES,
    WORKER_EXTENSIONS,
)
from engine.sdk.plugin import PluginOptions

if TYPE_CHECKING:
    from engine.core.startup import EngineSetup

logger = logging.getLogger("engine.plugins")

#: Groups whose plugins never receive options in SDK 1.x (no context carries them).
NO_OPTIONS_GROUPS = frozenset({GENERAL_PLUGINS, PLATFORMS, QUANTIZATION, LINEAR_KERNELS,
                               CUSTOM_OPS, WORKER_EXTENSIONS, ENDPOINTS})

#: Groups that use one plugin chosen by a flag: (config field, flag, what it is called).
_SELECTED_BY_FLAG = {
    SCHEDULERS: ("scheduler", "--scheduler", "scheduler"),
    SCHEDULING_POLICIES: ("scheduling_policy", "--scheduling-policy", "scheduling policy"),
    KV_CONNECTORS: ("kv_connector", "--kv-connector", "KV connector"),
    IO_PROCESSORS: ("io_processor", "--io-processor", "IO processor"),
}


def _short(group: str) -> str:
    return group.removeprefix("engine.")


def check_option_targets(config: EngineConfig, catalog: PluginCatalog) -> None:
    """Every ``--plugin-option`` key must name one allowed plugin (or a ``module:Class``).

    Raises:
        ValidationError: naming the unknown, skipped or ambiguous key and what is valid.
    """
    allowed = [e for e in catalog.entries if catalog.decision(e).allowed]
    groups_of: dict[str, set[str]] = {}
    for entry in allowed:
        groups_of.setdefault(entry.name, set()).add(entry.group)
    extra = set(config.plugin_selections())  # module:Class selections take options too
    qualified = {f"{e.group}:{e.name}" for e in allowed}
    unknown = sorted(key for key in config.plugin_options
                     if key not in qualified and key not in groups_of and key not in extra)
    for key in unknown:  # installed, but the allowlist skips it: say why
        skipped = [e for e in catalog.entries if key in (e.name, f"{e.group}:{e.name}")]
        if skipped:
            raise ValidationError(
                f"{identity(skipped[0])}: --plugin-option {key!r} gives it options, but it "
                f"is installed and not allowed ({catalog.decision(skipped[0]).reason}). "
                f"Allow it with {catalog.allowlist.source}, or drop the option.",
                param="plugin_options")
    if unknown:
        raise ValidationError(
            f"--plugin-option names {', '.join(map(repr, unknown))}, which "
            f"{'is' if len(unknown) == 1 else 'are'} not an installed plugin; installed and "
            f"allowed: {', '.join(sorted(set(groups_of) | extra))} (GROUP:NAME picks one "
            f"group; `engine plugins list` shows every plugin)",
            param="plugin_options")
    for key in config.plugin_options:
        groups = sorted(groups_of.get(key, ()))
        if len(groups) > 1:
            choices = ", ".join(f"{_short(g)}:{key}" for g in groups)
            raise ValidationError(
                f"--plugin-option {key!r} is ambiguous: plugins of {len(groups)} groups have "
                f"that name; write one of {choices} (e.g. --plugin-option "
                f"{_short(groups[0])}:{key}.KEY=VALUE)",
                param="plugin_options")


def option_targets(config: EngineConfig, catalog: PluginCatalog) -> list[PluginEntry]:
    """The installed plugins the ``--plugin-option`` keys name (``module:Class`` ones left out).

    Call after :func:`check_option_targets`, which makes each key name one plugin.
    """
    targets: dict[tuple[str, str], None] = {}
    for key in config.plugin_options:
        group, sep, name = key.partition(":")
        if sep and group.startswith("engine."):
            targets[(group, name)] = None
            continue
        for entry in catalog.entries:
            if entry.name == key and catalog.decision(entry).allowed:
                targets[entry.key] = None
    return [catalog.resolve(group, name) for group, name in targets]


def unused_reason(setup: EngineSetup, entry: PluginEntry) -> str | None:
    """Why ``entry``'s options cannot have an effect in this engine, or None if they may."""
    group, name, config = entry.group, entry.name, setup.config
    if group in NO_OPTIONS_GROUPS:
        return f"{group} plugins receive no options in SDK 1.x"
    if group in _SELECTED_BY_FLAG:
        field, flag, kind = _SELECTED_BY_FLAG[group]
        chosen = getattr(config, field)
        if chosen == name:
            return None
        if chosen is None:
            return f"no {kind} is selected ({flag})"
        return f"this engine uses {kind} {chosen!r} ({flag})"
    if group == ATTENTION_BACKENDS:
        chosen = setup.attention_backend or _default_attention_backend(setup)
        if chosen is None or chosen == name:
            return None
        how = "--attention-backend" if setup.attention_backend else "the platform's choice"
        return f"this engine uses attention backend {chosen!r} ({how})"
    if group == MODELS:
        architectures = list(getattr(setup.hf_config, "architectures", None) or [])
        models = setup.catalog.names(MODELS)
        chosen = next((arch for arch in architectures if arch in models), None)
        if chosen is None or chosen == name:
            return None
        return f"the checkpoint's architecture is served by {chosen!r}"
    return None  # every allowed logits processor and stat logger is used


def _default_attention_backend(setup: EngineSetup) -> str | None:
    """The backend the workers will pick when ``--attention-backend`` is not given."""
    from engine.core.worker.model_setup import probe_attention_spec

    try:
        spec = probe_attention_spec(setup.hf_config, setup.dtype, setup.block_size,
                                    setup.config.tensor_parallel_size)
        return setup.platform.default_attention_backend(spec)
    except Exception:  # noqa: BLE001 - undecidable here: the worker validates it if used
        return None


def describe_options(options_cls: type[PluginOptions]) -> str:
    """``Accepted options: port (int >= 1, <= 65535, default 8125), ...``.

    ``It accepts no options`` for an empty ``Options`` model.
    """
    fields = options_cls.model_fields
    if not fields:
        return "It accepts no options"
    parts = []
    for field_name, info in fields.items():
        annotation = info.annotation
        kind = (annotation.__name__ if isinstance(annotation, type)
                else str(annotation).replace("typing.", ""))
        bounds = [f"{symbol} {getattr(m, attr)}" for m in info.metadata
                  for attr, symbol in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
                  if getattr(m, attr, None) is not None]
        default = ("required" if info.is_required() else "default computed"
                   if info.default_factory is not None else f"default {info.default!r}")
        parts.append(f"{field_name} ({' '.join([kind, ', '.join(bounds)]).strip()}, "
                     f"{default})")
    return f"Accepted options: {', '.join(parts)}"


def _errors(exc: pydantic.ValidationError) -> str:
    """``key: what is wrong (got VALUE)`` for each error, ``; ``-separated."""
    parts = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error["loc"]) or "options"
        got = "" if error["type"] == "extra_forbidden" else f" (got {error['input']!r})"
        parts.append(f"{where}: {error['msg']}{got}")
    return "; ".join(parts)


def _options_class(obj: Any) -> type[PluginOptions]:
    options = getattr(obj, "Options", None) if isinstance(obj, type) else None
    if isinstance(options, type) and issubclass(options, PluginOptions):
        return options
    return PluginOptions  # a callable entry (general plugin, platform, endpoint factory)


def _keys_for(config: EngineConfig, entry: PluginEntry) -> Iterable[str]:
    return [key for key in (entry.name, f"{entry.group}:{entry.name}")
            if key in config.plugin_options]


def check_unused_options(setup: EngineSetup) -> None:
    """Validate the options of every named plugin that will not validate them itself.

    See the module docstring. Call in the front end once ``setup`` is resolved.

    Raises:
        PluginError: a value does not validate, naming the plugin, its group and
            distribution, what was wrong and the options it accepts.
    """
    config, catalog = setup.config, setup.catalog
    for entry in option_targets(config, catalog):
        reason = unused_reason(setup, entry)
        if reason is None:
            continue  # validated where the engine builds it
        options_cls = _options_class(catalog.load(entry.group, entry.name))
        keys = " and ".join(f"--plugin-option {key}" for key in _keys_for(config, entry))
        try:
            options_cls(**config.options_for(entry.group, entry.name))
        except pydantic.ValidationError as exc:
            raise plugin_error(
                entry, f"invalid {keys}: {_errors(exc)}. {describe_options(options_cls)} "
                f"(checked although they would have no effect: {reason})") from exc
        logger.info("%s: %s is valid but has no effect: %s", identity(entry), keys, reason)
