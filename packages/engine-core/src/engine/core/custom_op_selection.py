"""Which custom ops use a replacement: ``--custom-ops`` and the platform's ``custom_ops``.

Every built-in op (``engine.sdk.ops.BUILTIN_OPS``: ``rms_norm``, ``rotary_embedding``,
``silu_and_mul``) is built from one class: the engine's built-in implementation
(``engine.core.model_executor.layers.builtin_ops``: the contract's reference, with the
engine's C++ kernels on the CPU) or the replacement that an allowed ``engine.custom_ops``
entry registers under the op's name. Which one is decided by a list of items applied in
order, a later item winning for the ops it names::

    (nothing)       every op that has an allowed replacement with a path of its own for
                    the device uses it (one whose path there is the contract's reference,
                    inherited, would only lose the built-in's kernels; the worker's log
                    says so)
    all             every op that has an allowed replacement uses it
    none            no op uses a replacement
    +NAME or NAME   NAME uses its replacement
    -NAME           NAME uses the built-in

The list is the platform's items (``PlatformConfig.custom_ops`` as
``Platform.check_and_update_config`` left it; it starts as the operator's items) followed
by the operator's ``--custom-ops``: **the operator's flag wins** for every op it names, and
its ``all`` / ``none`` win for every op. Validation, before any weights load:

* a NAME that is not a built-in op is an error listing the ops (naming the platform when
  the platform set it);
* ``+NAME`` from the operator with no allowed replacement installed is an error (it would
  change nothing); from the platform it is ignored (a platform may enable ops generically).

:class:`CustomOpSettings` holds both lists (``EngineSetup.custom_ops``);
:func:`plan_custom_ops` reads metadata only (``engine plugins list`` shows it);
:func:`select_custom_ops` imports and checks the replacements in use (the worker).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from engine.core.plugins import PluginCatalog, PluginEntry
from engine.sdk.errors import PluginError, ValidationError
from engine.sdk.groups import CUSTOM_OPS
from engine.sdk.ops import BUILTIN_OPS, NATIVE, CustomOp, check_replacement

logger = logging.getLogger("engine.worker")

#: Where an item came from, as messages name it.
OPERATOR = "--custom-ops"


@dataclass(frozen=True)
class CustomOpItem:
    """One parsed item: ``op`` is a built-in op name, or ``None`` for ``all`` / ``none``."""

    text: str
    op: str | None
    enable: bool
    source: str


def _ops_list() -> str:
    return ", ".join(sorted(BUILTIN_OPS))


def parse_custom_op_items(items: Iterable[str], *, source: str = OPERATOR
                          ) -> list[CustomOpItem]:
    """Parse ``all``, ``none``, ``+NAME``, ``NAME``, ``-NAME`` items.

    Raises:
        ValidationError: an empty item or an unknown op name, listing the ops
            (``param="custom_ops"``).
    """
    parsed = []
    for raw in items:
        text = raw.strip()
        where = (OPERATOR if source == OPERATOR
                 else f"PlatformConfig.custom_ops as {source} set it")
        if text in ("all", "none"):
            parsed.append(CustomOpItem(text, None, text == "all", source))
            continue
        enable = not text.startswith("-")
        name = text[1:] if text[:1] in "+-" and text else text
        if name not in BUILTIN_OPS:
            what = "an empty item" if not name else f"{text!r}: there is no op {name!r}"
            raise ValidationError(
                f"{where} has {what}; items are all, none, +NAME or -NAME with NAME one of "
                f"the ops: {_ops_list()}", param="custom_ops")
        parsed.append(CustomOpItem(text, name, enable, source))
    return parsed


@dataclass(frozen=True)
class CustomOpSettings:
    """The custom-op items of one engine: the platform's, then the operator's.

    Attributes:
        operator: ``--custom-ops`` items (``EngineConfig.custom_ops``).
        platform: ``PlatformConfig.custom_ops`` after ``check_and_update_config``.
        platform_name: The platform that set ``platform``.
    """

    operator: tuple[str, ...] = ()
    platform: tuple[str, ...] = ()
    platform_name: str = ""

    def items(self) -> list[CustomOpItem]:
        """Every item in the order it applies: the platform's, then the operator's."""
        source = f"platform {self.platform_name or '?'}"
        return [*parse_custom_op_items(self.platform, source=source),
                *parse_custom_op_items(self.operator)]

    def validate(self, catalog: PluginCatalog) -> None:
        """Check every item (see the module docstring); reads metadata only.

        Raises:
            ValidationError: an unknown op name, or an operator's ``+NAME`` without an
                allowed replacement, saying which replacements exist.
        """
        operator = parse_custom_op_items(self.operator)  # the operator's mistakes first:
        self.items()  # the platform's list starts as a copy of the operator's
        installed = set(catalog.names(CUSTOM_OPS))
        for item in operator:
            if item.enable and item.op is not None and item.op not in installed:
                have = ", ".join(sorted(installed & set(BUILTIN_OPS))) or "none"
                raise ValidationError(
                    f"--custom-ops {item.text}: no allowed engine.custom_ops entry replaces "
                    f"{item.op!r}, so there is nothing to enable (ops with an allowed "
                    f"replacement: {have}); install one, or drop the item",
                    param="custom_ops")


def resolve_settings(operator: Sequence[str], platform_items: Sequence[str],
                     platform_name: str, catalog: PluginCatalog) -> CustomOpSettings:
    """The validated settings of one engine (``startup.prepare`` calls it).

    Raises:
        ValidationError: see :meth:`CustomOpSettings.validate`.
    """
    settings = CustomOpSettings(tuple(operator), tuple(platform_items), platform_name)
    settings.validate(catalog)
    return settings


@dataclass(frozen=True)
class CustomOpChoice:
    """What one op is built from.

    Attributes:
        name: The op.
        replacement: The allowed ``engine.custom_ops`` entry for it, if one is installed.
        use_replacement: Whether the op is built from ``replacement``.
        reason: Why, in words (``"default"``, ``"--custom-ops -rms_norm"``, ...).
        by_default: No item named the op (the default rule decided).
    """

    name: str
    replacement: PluginEntry | None
    use_replacement: bool
    reason: str
    by_default: bool = False

    @property
    def implementation(self) -> str:
        """``built-in engine.core...:RMSNorm`` or the replacement's value and provider."""
        if self.use_replacement and self.replacement is not None:
            return f"{self.replacement.value} ({self.replacement.provider})"
        # Imported here: the front end plans ops too, and never imports worker code.
        from engine.core.model_executor.layers.builtin_ops import BUILTIN_IMPLEMENTATIONS

        builtin = BUILTIN_IMPLEMENTATIONS[self.name]
        return f"built-in {builtin.__module__}:{builtin.__qualname__}"


def _replacements(catalog: PluginCatalog) -> dict[str, PluginEntry]:
    """The allowed entry of each op name (the first one where two conflict: resolve errs)."""
    found: dict[str, PluginEntry] = {}
    for entry in catalog.allowed(CUSTOM_OPS):
        found.setdefault(entry.name, entry)
    return found


def plan_custom_ops(catalog: PluginCatalog, settings: CustomOpSettings) -> list[CustomOpChoice]:
    """Each built-in op's choice, from installed metadata and ``settings`` (no imports)."""
    replacements = _replacements(catalog)
    enabled = {name: (name in replacements, "default: an allowed replacement is used"
                      if name in replacements else "no replacement is installed", True)
               for name in sorted(BUILTIN_OPS)}
    for item in settings.items():
        by = item.source if item.source == OPERATOR else f"the {item.source}"
        for name in ([item.op] if item.op is not None else list(enabled)):
            if name not in replacements:
                continue  # nothing to enable or disable: the built-in either way
            enabled[name] = (item.enable, f"{by}: {item.text}", False)
    return [CustomOpChoice(name, replacements.get(name), use, reason, by_default)
            for name, (use, reason, by_default) in enabled.items()]


def _own_path(name: str, cls: type[CustomOp], dispatch_key: str) -> bool:
    """Whether ``cls`` runs code of its own with ``dispatch_key``.

    It does when it overrides that key's forward method or ``forward_native`` (which the
    contract's other methods call).
    """
    if dispatch_key == NATIVE:
        return True
    method = CustomOp.method_for(dispatch_key)
    contract = BUILTIN_OPS[name]
    return any(getattr(cls, m) is not getattr(contract, m) for m in (method, "forward_native"))


def _unknown_replacements(catalog: PluginCatalog, settings: CustomOpSettings
                          ) -> list[PluginEntry]:
    """Allowed entries naming no built-in op that the settings would use."""
    unknown = [e for e in catalog.allowed(CUSTOM_OPS) if e.name not in BUILTIN_OPS]
    last_global = [item for item in settings.items() if item.op is None]
    if last_global and not last_global[-1].enable:
        return []  # ``none``: no replacement is used, known or not
    return unknown


def select_custom_ops(catalog: PluginCatalog, settings: CustomOpSettings | None = None,
                      dispatch_key: str = NATIVE) -> dict[str, type[CustomOp]]:
    """The replacement class of every op that uses one, imported and checked.

    Called: in each worker, once, while the model is built with ``dispatch_key`` (the
    platform's device type). Logs one INFO line saying what every op is built from.

    Raises:
        PluginError: a replacement in use fails to import, breaks its op's contract
            (``check_replacement``), or is registered under a name that is no built-in
            op, naming the plugin and its distribution.
    """
    settings = settings or CustomOpSettings()
    for entry in _unknown_replacements(catalog, settings):
        raise PluginError(f"there is no built-in op named {entry.name!r} to replace; ops: "
                          f"{_ops_list()}", plugin=entry.name, group=CUSTOM_OPS,
                          distribution=entry.distribution, version=entry.version)
    ops: dict[str, type[CustomOp]] = {}
    choices = plan_custom_ops(catalog, settings)
    for i, choice in enumerate(choices):
        if not choice.use_replacement:
            continue
        entry = catalog.resolve(CUSTOM_OPS, choice.name)  # raises on a conflict
        cls = catalog.load(CUSTOM_OPS, choice.name)
        support = check_replacement(choice.name, cls)
        if not support.ok:
            raise PluginError(support.reason, plugin=entry.name, group=CUSTOM_OPS,
                              distribution=entry.distribution, version=entry.version)
        if choice.by_default and not _own_path(choice.name, cls, dispatch_key):
            choices[i] = replace(choice, use_replacement=False, reason=(
                f"default: {entry.value} ({entry.provider}) has no {dispatch_key} path of its "
                f"own; --custom-ops +{choice.name} uses it anyway"))
            continue
        ops[choice.name] = cls
    logger.info("custom ops: %s", "; ".join(
        f"{c.name} = {c.implementation} [{c.reason}]" for c in choices))
    return ops


__all__ = ["OPERATOR", "CustomOpChoice", "CustomOpItem", "CustomOpSettings",
           "parse_custom_op_items", "plan_custom_ops", "resolve_settings", "select_custom_ops"]
