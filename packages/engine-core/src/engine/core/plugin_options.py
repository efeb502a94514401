"""``--plugin-option`` values: one validation for every group, and no value unchecked.

:func:`validated_options` is the one place a plugin's options are validated against its
``Options`` model, wherever the engine builds the plugin
(:mod:`engine.core.plugin_construction` for most groups, the worker's model setup for
models and attention backends, the KV connector's construction) and at start-up. A bad
value is a
:class:`~engine.sdk.errors.PluginError` naming the plugin, group and distribution, the
``--plugin-option`` key, what was wrong with each value and what the ``Options`` model
accepts (:func:`describe_options`).

The front end's :func:`engine.core.startup.prepare` adds two checks, so that no value is
silently dropped and none is found wrong only after the model loaded:

1. :func:`check_option_targets` (before general plugins run): every key names one
   installed, allowed plugin (``NAME`` unique across groups, or ``GROUP:NAME``), or a
   plugin selected as ``module:Class``. A name that nothing installed provides is an error
   listing the allowed plugins; an installed plugin the allowlist skips is an error saying
   why; a plain name two groups share is an error listing the ``GROUP:NAME`` spellings.
2. :func:`check_plugin_options` (once the engine's choices are known): the values of every
   named plugin, and the options of every stat logger (all of them are used, and they are
   built only once EngineCore is up), are validated now, which imports those plugins.
   Values of a plugin that cannot use them are accepted and logged at INFO as having no
   effect, with the reason (:func:`unused_reason`):

   * a plugin this engine does not use (another scheduling policy than
     ``--scheduling-policy``, another structured-output backend than
     ``--structured-outputs-backend``, an IO processor or KV connector while none or
     another is selected, an attention backend other than the one the platform picks, a
     model for another architecture);
   * a plugin of a group whose plugins receive no options in SDK 1.x (general plugins,
     platforms, quantization, linear kernels, custom ops, worker extensions, endpoints).

   Tool parsers are chosen by the server (``--tool-call-parser``), not by the engine's
   config: :func:`check_application_options` checks them once the application made its
   choice (the server when it loads its parser, ``LLM``, which parses no tool calls, at
   start-up).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pydantic

from engine.core.config import EngineConfig, plugin_options_for
from engine.core.plugins import PluginCatalog, PluginEntry
from engine.core.plugins._loader import identity, plugin_error
from engine.sdk.errors import PluginError, ValidationError
from engine.sdk.groups import (
    ATTENTION_BACKENDS,
    CUSTOM_OPS,
    ENDPOINTS,
    GENERAL_PLUGINS,
    IO_PROCESSORS,
    KV_CONNECTORS,
    LINEAR_KERNELS,
    LOGITS_PROCESSORS,
    MODELS,
    PLATFORMS,
    QUANTIZATION,
    SCHEDULERS,
    SCHEDULING_POLICIES,
    STAT_LOGGERS,
    STRUCTURED_OUTPUT_BACKENDS,
    TOOL_PARSERS,
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
    STRUCTURED_OUTPUT_BACKENDS: ("structured_outputs_backend", "--structured-outputs-backend",
                                 "structured-output backend"),
}

#: Groups of which every allowed plugin is used.
ALL_USED_GROUPS = frozenset({LOGITS_PROCESSORS, STAT_LOGGERS})

#: Groups whose plugin the application on top of the engine chooses (the server), not
#: ``EngineConfig``: (flag, what it is called). See :func:`check_application_options`.
APPLICATION_CHOICES = {TOOL_PARSERS: ("--tool-call-parser", "tool parser")}

#: Groups whose plugin in use the platform or the checkpoint decides at start-up.
DECIDED_AT_START_UP = frozenset({ATTENTION_BACKENDS, MODELS})


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
    """Why ``entry``'s options cannot have an effect in this engine, or None if they may.

    Tool parsers (:data:`APPLICATION_CHOICES`) are the application's choice: None here.
    """
    group, name, config = entry.group, entry.name, setup.config
    if group in NO_OPTIONS_GROUPS:
        return f"{group} plugins receive no options in SDK 1.x"
    if group in _SELECTED_BY_FLAG:
        field, flag, kind = _SELECTED_BY_FLAG[group]
        return _choice_reason(getattr(config, field), name, flag, kind, "engine")
    if group == ATTENTION_BACKENDS:
        chosen = setup.attention_backend or _default_attention_backend(setup)
        if chosen is None or chosen == name:
            return None
        how = "--attention-backend" if setup.attention_backend else "the platform's choice"
        return f"this engine uses attention backend {chosen!r} ({how})"
    if group == MODELS:
        chosen = None if setup.model is None else setup.model.architecture
        if chosen is None or chosen == name:
            return None
        return f"the checkpoint's architecture is served by {chosen!r}"
    return None  # ALL_USED_GROUPS, APPLICATION_CHOICES


def _choice_reason(chosen: str | None, name: str, flag: str, kind: str, who: str,
                   ) -> str | None:
    if chosen == name:
        return None
    if chosen is None:
        return f"no {kind} is selected ({flag})"
    return f"this {who} uses {kind} {chosen!r} ({flag})"


def _default_attention_backend(setup: EngineSetup) -> str | None:
    """The backend the workers will pick when ``--attention-backend`` is not given.

    None where only the workers can tell: they measure the candidates on the CPU
    (``--kernel-selection measured``, ``engine.core.kernel_choice.attention_selection``).
    """
    from engine.core.worker.model_setup import probe_attention_spec

    if setup.config.kernel_selection == "measured" and setup.platform.device_type == "cpu":
        return None
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
        got = ("" if error["type"] in ("extra_forbidden", "missing")
               else f" (got {error['input']!r})")
        parts.append(f"{where}: {error['msg']}{got}")
    return "; ".join(parts)


def _options_class(obj: Any) -> type[PluginOptions]:
    options = getattr(obj, "Options", None) if isinstance(obj, type) else None
    if isinstance(options, type) and issubclass(options, PluginOptions):
        return options
    return PluginOptions  # a callable entry (general plugin, platform, endpoint factory)


def validated_options(catalog: PluginCatalog, group: str, name: str, plugin: Any,
                      plugin_options: Mapping[str, Mapping[str, Any]], *,
                      flag_values: tuple[str, Mapping[str, Any]] | None = None,
                      unused: str | None = None, entry: PluginEntry | None = None,
                      ) -> PluginOptions:
    """``plugin.Options`` from the values given for ``name``: how every group checks options.

    Args:
        catalog: The catalog that names the plugin (and its distribution) in an error.
        group: The plugin's group.
        name: The plugin as it was selected (an entry name or ``module:Class``).
        plugin: The loaded entry: a class with an ``Options`` model (anything else accepts
            no options).
        plugin_options: ``EngineConfig.plugin_options`` (``--plugin-option``); values given
            as ``GROUP:NAME`` override those given as ``NAME``.
        flag_values: ``(flag, values)`` of a group's own option flag, overriding both
            (``--kv-connector-option``).
        unused: Why the values would have no effect, said in the error; None when the
            plugin is used.
        entry: The entry an error names, where ``name`` alone does not say which of
            several same-named entries is meant (a model chosen by ``--model-impl``).

    Returns:
        The validated options.

    Raises:
        PluginError: a value does not validate (or a required one is missing), naming the
            plugin, group and distribution, where the values came from, each key and what
            was wrong with it, and the options the plugin accepts.
    """
    def error(cause: str) -> PluginError:
        return plugin_error(entry, cause) if entry is not None else catalog.error(
            group, name, cause)

    options_cls = _options_class(plugin)
    values = plugin_options_for(plugin_options, group, name)
    given = _given_keys(plugin_options, group, name)
    if flag_values is not None and flag_values[1]:
        values.update(flag_values[1])
        given.append(flag_values[0])
    try:
        return options_cls(**values)
    except pydantic.ValidationError as exc:
        problems = _errors(exc)
    except Exception as exc:
        raise error(f"validating its options raised {type(exc).__name__}: {exc}") from exc
    source = " and ".join(given) if given else "options (none given)"
    note = "" if unused is None else f" (checked although they would have no effect: {unused})"
    raise error(f"invalid {source}: {problems}. {describe_options(options_cls)}{note}"
                ) from None


def check_plugin_options(setup: EngineSetup) -> None:
    """Validate the options of every named plugin and of every stat logger (front end).

    See the module docstring. Call in the front end once ``setup`` is resolved; tool
    parsers wait for :func:`check_application_options`.

    Raises:
        PluginError: a value does not validate, naming the plugin, its group and
            distribution, what was wrong and the options it accepts.
    """
    config, catalog = setup.config, setup.catalog
    targets = option_targets(config, catalog)
    entries = {e.key: e for e in [*targets, *catalog.allowed(STAT_LOGGERS)]}
    for entry in entries.values():
        if entry.group in APPLICATION_CHOICES:
            continue
        reason = unused_reason(setup, entry)
        flag_values = (("--kv-connector-option", config.kv_connector_options)
                       if entry.group == KV_CONNECTORS and reason is None else None)
        _check(setup, entry, reason, flag_values)


def check_application_options(setup: EngineSetup, group: str, chosen: str | None, *,
                              unused: str | None = None) -> None:
    """Validate the ``--plugin-option`` values of a group the application chooses from.

    The server calls it for ``engine.tool_parsers`` when it loads its ``--tool-call-parser``
    (``chosen``; None: none); ``LLM``, which parses no tool calls, at start-up with
    ``unused`` saying so. Values of a plugin other than ``chosen`` are logged as having no
    effect, as :func:`check_plugin_options` does for the engine's groups.

    Raises:
        PluginError: a value does not validate, naming the plugin, what was wrong and the
            options it accepts.
    """
    flag, kind = APPLICATION_CHOICES[group]
    for entry in option_targets(setup.config, setup.catalog):
        if entry.group == group:
            reason = unused or _choice_reason(chosen, entry.name, flag, kind, "server")
            _check(setup, entry, reason)


def _check(setup: EngineSetup, entry: PluginEntry, reason: str | None,
           flag_values: tuple[str, Mapping[str, Any]] | None = None) -> None:
    """Validate ``entry``'s options; log them as having no effect when ``reason`` says so."""
    config = setup.config
    validated_options(setup.catalog, entry.group, entry.name,
                      setup.catalog.load(entry.group, entry.name), config.plugin_options,
                      flag_values=flag_values, unused=reason)
    if reason is not None:
        keys = " and ".join(_given_keys(config.plugin_options, entry.group, entry.name))
        logger.info("%s: %s is valid but has no effect: %s", identity(entry), keys, reason)


def _given_keys(plugin_options: Mapping[str, Mapping[str, Any]], group: str,
                name: str) -> list[str]:
    """``--plugin-option NAME`` and/or ``--plugin-option GROUP:NAME``: how they were given."""
    return [f"--plugin-option {key}" for key in (name, f"{group}:{name}")
            if key in plugin_options]
