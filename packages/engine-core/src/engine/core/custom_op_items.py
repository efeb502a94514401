"""``--custom-ops`` and the platform's ``custom_ops``: the items, parsed and validated.

An op (``engine.sdk.ops.BUILTIN_OPS``: ``rms_norm``, ``rotary_embedding``,
``silu_and_mul``) is built from one of its implementations: the engine's built-in
(engine-core's ``engine.custom_ops`` entry: the contract's reference, with the engine's C++
kernels on the CPU) or a replacement (any other allowed entry named after the op:
engine-kernels' Triton ops, a third party's). ``engine.core.custom_op_selection`` chooses;
these items steer it, applied in order, a later item winning for the ops it names::

    (nothing)       the default rule: the highest-priority implementation that can run on
                    the device; at equal priority a third party's beats the engine's own
    all             every op that has a replacement uses its best one, even one without
                    a path of its own for the device
    none            no op uses a replacement
    +NAME or NAME   NAME uses its best replacement (as ``all`` does, for NAME only)
    +NAME=CHOICE    NAME uses the implementation CHOICE: the distribution that provides it
                    (``acme-ops``; ``engine-core`` for the built-in) or a class path
                    (``acme.ops:FusedRMSNorm``, which needs no entry point)
    -NAME           NAME uses the built-in

The list is the platform's items (``PlatformConfig.custom_ops`` as
``Platform.check_and_update_config`` left it; it starts as the operator's items) followed
by the operator's ``--custom-ops``: **the operator's flag wins** for every op it names, and
its ``all`` / ``none`` win for every op. Validation, before any weights load, reads
metadata only:

* a NAME that is not a built-in op is an error listing the ops (naming the platform when
  the platform set it);
* ``+NAME`` from the operator with no allowed replacement installed is an error (it would
  change nothing); so is ``+NAME=CHOICE`` naming a distribution that provides no allowed
  implementation of NAME (listing those that do). From the platform, both are ignored.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from engine.core.plugins import PluginCatalog, normalize_dist_name
from engine.sdk.errors import ValidationError
from engine.sdk.groups import CUSTOM_OPS
from engine.sdk.ops import BUILTIN_OPS

#: Where an item came from, as messages name it.
OPERATOR = "--custom-ops"

#: The distribution whose ``engine.custom_ops`` entries are the built-in implementations.
BUILTIN_DISTRIBUTION = "engine-core"

_SYNTAX = ("items are all, none, +NAME, +NAME=CHOICE or -NAME with NAME one of the ops: {ops}"
           " (CHOICE: a distribution providing the op, or a module:Class)")


@dataclass(frozen=True)
class CustomOpItem:
    """One parsed item.

    Attributes:
        text: The item as written.
        op: A built-in op name, or ``None`` for ``all`` / ``none``.
        enable: False for ``-NAME`` and ``none``.
        source: :data:`OPERATOR`, or ``platform NAME``.
        choice: ``+NAME=CHOICE``'s CHOICE: a normalised distribution name or a
            ``module:Class``; None otherwise.
    """

    text: str
    op: str | None
    enable: bool
    source: str
    choice: str | None = None


def _ops_list() -> str:
    return ", ".join(sorted(BUILTIN_OPS))


def _parse_one(text: str, source: str) -> CustomOpItem:
    where = (OPERATOR if source == OPERATOR
             else f"PlatformConfig.custom_ops as {source} set it")
    if text in ("all", "none"):
        return CustomOpItem(text, None, text == "all", source)
    enable = not text.startswith("-")
    spec = text[1:] if text[:1] in "+-" and text else text
    name, equals, choice = spec.partition("=")
    name, choice = name.strip(), choice.strip()
    if name not in BUILTIN_OPS:
        what = "an empty item" if not name else f"{text!r}: there is no op {name!r}"
        raise ValidationError(f"{where} has {what}; {_SYNTAX.format(ops=_ops_list())}",
                              param="custom_ops")
    if equals and (not enable or not choice):
        what = ("-NAME takes no =CHOICE (it means the built-in; +NAME=engine-core says the "
                "same)" if not enable else "=CHOICE is empty")
        raise ValidationError(f"{where} has {text!r}: {what}; "
                              f"{_SYNTAX.format(ops=_ops_list())}", param="custom_ops")
    if equals and ":" not in choice:
        choice = normalize_dist_name(choice)
    return CustomOpItem(text, name, enable, source, choice if equals else None)


def parse_custom_op_items(items: Iterable[str], *, source: str = OPERATOR
                          ) -> list[CustomOpItem]:
    """Parse ``all``, ``none``, ``+NAME``, ``NAME``, ``+NAME=CHOICE``, ``-NAME`` items.

    Raises:
        ValidationError: an empty item, an unknown op name (listing the ops) or a
            malformed ``=CHOICE`` (``param="custom_ops"``).
    """
    return [_parse_one(raw.strip(), source) for raw in items]


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
            ValidationError: an unknown op name, an operator's ``+NAME`` without an
                allowed replacement, or an operator's ``+NAME=CHOICE`` naming a
                distribution without an allowed implementation of NAME, saying what exists.
        """
        operator = parse_custom_op_items(self.operator)  # the operator's mistakes first:
        self.items()  # the platform's list starts as a copy of the operator's
        for item in operator:
            if item.op is None or not item.enable:
                continue
            providers = providers_of(catalog, item.op)
            if item.choice is None and providers == [BUILTIN_DISTRIBUTION]:
                have = ", ".join(op for op in sorted(BUILTIN_OPS)
                                 if providers_of(catalog, op) != [BUILTIN_DISTRIBUTION])
                raise ValidationError(
                    f"--custom-ops {item.text}: no allowed engine.custom_ops entry replaces "
                    f"{item.op!r}, so there is nothing to enable (ops with an allowed "
                    f"replacement: {have or 'none'}); install one, or drop the item",
                    param="custom_ops")
            if item.choice is not None and ":" not in item.choice and (
                    item.choice not in providers):
                raise ValidationError(
                    f"--custom-ops {item.text}: no allowed distribution {item.choice!r} "
                    f"provides {item.op!r}; its implementations come from "
                    f"{', '.join(providers)} (or give a class as +{item.op}=module:Class); "
                    f"`engine plugins list` shows them", param="custom_ops")


def providers_of(catalog: PluginCatalog, op: str) -> list[str]:
    """The distributions with an allowed implementation of ``op``, the built-in first."""
    found = {e.distribution or e.value for e in catalog.candidates(CUSTOM_OPS, op)}
    found.add(BUILTIN_DISTRIBUTION)
    return sorted(found, key=lambda d: (d != BUILTIN_DISTRIBUTION, d))


def resolve_settings(operator: Sequence[str], platform_items: Sequence[str],
                     platform_name: str, catalog: PluginCatalog) -> CustomOpSettings:
    """The validated settings of one engine (``startup.prepare`` calls it).

    Raises:
        ValidationError: see :meth:`CustomOpSettings.validate`.
    """
    settings = CustomOpSettings(tuple(operator), tuple(platform_items), platform_name)
    settings.validate(catalog)
    return settings


__all__ = ["BUILTIN_DISTRIBUTION", "OPERATOR", "CustomOpItem", "CustomOpSettings",
           "parse_custom_op_items", "providers_of", "resolve_settings"]
