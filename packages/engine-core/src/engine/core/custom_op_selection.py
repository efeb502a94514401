"""Which implementation each custom op is built from.

Every implementation of an op is a candidate: the allowed ``engine.custom_ops`` entries
named after it, from any distribution (engine-core's built-in references and
engine-kernels' C++ and Triton ops among them, installed beside any number of third
parties' replacements), plus a class the operator names as ``+NAME=module:Class``.
Nothing about several of them is an error at start-up. For each op, the items of
``engine.core.custom_op_items`` leave one mode:

* **default** (no item names the op): each candidate is imported and asked
  ``is_supported(platform)`` (by default: does it have a path of its own for the device);
  the eligible ones are ranked by ``priority`` (higher first), then a third party's before
  the engine's own. A tie at the top between two third parties is an error that names both
  and how to choose; nothing eligible leaves the built-in (the reference on a device it
  has no kernels for). In a worker on the CPU under ``--kernel-selection measured`` (the
  default), two or more eligible ones are timed on the model's shapes instead
  (``engine.core.kernel_choice.op_selection``) and the fastest is used, whatever the
  priorities (a tie between third parties is then no error).
* **replace** (``all``, ``+NAME``): the same ranking over the replacements only (every
  candidate but the built-in), eligible ones first; an ineligible one is used when it is
  the only replacement (the operator asked for a replacement).
* **pick** (``+NAME=CHOICE``): that distribution's implementation, or that class, whatever
  its ``is_supported`` says (logged).
* **builtin** (``-NAME``, ``none``): the built-in; replacements are not imported.

Called in each worker while it builds the model (:func:`select_custom_ops`, which logs
one INFO line with every op's implementation and why) and by ``engine plugins list``
(:func:`plan_custom_ops`, which reports failures per op instead of raising).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.core.custom_op_items import (
    BUILTIN_DISTRIBUTION,
    OPERATOR,
    CustomOpItem,
    CustomOpSettings,
    parse_custom_op_items,
    resolve_settings,
)
from engine.core.plugins import PluginCatalog, PluginEntry
from engine.core.plugins._loader import plugin_error
from engine.sdk.errors import PluginError
from engine.sdk.groups import CUSTOM_OPS
from engine.sdk.ops import BUILTIN_OPS, NATIVE, CustomOp, check_replacement
from engine.sdk.platform import PlatformInfo
from engine.sdk.support import Support

logger = logging.getLogger("engine.worker")

#: Times an op's eligible implementations and returns the fastest's entry (None: nothing
#: measured); ``engine.core.kernel_choice.op_selection.OpMeasurer`` in a worker on the CPU.
OpMeasure = Callable[[str, Sequence[tuple[PluginEntry, type[CustomOp]]]], PluginEntry | None]


@dataclass(frozen=True)
class OpCandidate:
    """One implementation of an op, as the choice saw it.

    Attributes:
        entry: Where it comes from.
        priority: Its class's ``priority`` (None: not imported).
        support: Its ``is_supported`` answer on the device (None: not asked).
    """

    entry: PluginEntry
    priority: int | None = None
    support: Support | None = None

    @property
    def is_builtin(self) -> bool:
        """Whether it is engine-core's built-in implementation."""
        return self.entry.distribution == BUILTIN_DISTRIBUTION

    @property
    def label(self) -> str:
        """``value (distribution version)``."""
        return f"{self.entry.value} ({self.entry.provider})"


@dataclass(frozen=True)
class CustomOpChoice:
    """What one op is built from, and why.

    Attributes:
        name: The op.
        chosen: The implementation's entry (the built-in's for the built-in).
        reason: Why, in words (``"--custom-ops: -rms_norm"``, ``"default: ..."``).
        candidates: Every implementation considered, the chosen one included.
        by_default: No item named the op (the default rule decided).
        error: Why no choice could be made (``plan_custom_ops(strict=False)`` only).
        passed_over: Each ineligible candidate the default rule passed over, with why.
    """

    name: str
    chosen: PluginEntry
    reason: str
    candidates: tuple[OpCandidate, ...] = ()
    by_default: bool = False
    error: str | None = None
    passed_over: tuple[str, ...] = ()

    @property
    def full_reason(self) -> str:
        """``reason``, then what was passed over and how to force it (the worker's log)."""
        if not self.passed_over:
            return self.reason
        return (f"{self.reason}; passed over: {'; '.join(self.passed_over)}; --custom-ops "
                f"+{self.name}=DISTRIBUTION forces one")

    @property
    def use_replacement(self) -> bool:
        """Whether the op is built from something other than the built-in."""
        return self.chosen.distribution != BUILTIN_DISTRIBUTION

    @property
    def implementation(self) -> str:
        """``built-in engine.core...:RMSNorm`` or the replacement's value and provider."""
        if self.use_replacement:
            return f"{self.chosen.value} ({self.chosen.provider})"
        return f"built-in {self.chosen.value}"


@dataclass
class _Mode:
    kind: str = "default"  # default | replace | pick | builtin
    item: CustomOpItem | None = None


def builtin_entry(catalog: PluginCatalog, op: str) -> PluginEntry:
    """engine-core's entry for ``op`` (made from the built-in class if the catalog lacks it)."""
    for entry in catalog.candidates(CUSTOM_OPS, op):
        if entry.distribution == BUILTIN_DISTRIBUTION:
            return entry
    # Imported here: worker code (a catalog without engine-core's entries is a test's).
    from engine.core._version import __version__
    from engine.core.model_executor.layers.builtin_ops import BUILTIN_IMPLEMENTATIONS

    cls = BUILTIN_IMPLEMENTATIONS[op]
    return PluginEntry(CUSTOM_OPS, op, f"{cls.__module__}:{cls.__qualname__}",
                       BUILTIN_DISTRIBUTION, __version__)


def _entries(catalog: PluginCatalog, op: str) -> list[PluginEntry]:
    """Every allowed implementation of ``op``, the built-in first."""
    builtin = builtin_entry(catalog, op)
    return [builtin, *(e for e in catalog.candidates(CUSTOM_OPS, op)
                       if e.distribution != BUILTIN_DISTRIBUTION)]


def _modes(catalog: PluginCatalog, settings: CustomOpSettings) -> dict[str, _Mode]:
    """Each op's mode after every item (module docstring).

    An item that cannot apply to an op (no replacement to enable, a platform's CHOICE that
    is not installed) leaves its mode as it was.
    """
    modes = {name: _Mode() for name in sorted(BUILTIN_OPS)}
    for item in settings.items():
        for name in [item.op] if item.op is not None else list(modes):
            entries = _entries(catalog, name)
            if item.choice is not None:
                if ":" in item.choice or any(e.distribution == item.choice for e in entries):
                    modes[name] = _Mode("pick", item)
                continue
            if not item.enable:
                modes[name] = _Mode("builtin", item)
            elif len(entries) > 1:
                modes[name] = _Mode("replace", item)
    return modes


def _load(catalog: PluginCatalog, op: str, entry: PluginEntry) -> type[CustomOp]:
    """Import ``entry`` and check it against the op's contract.

    Raises:
        PluginError: it does not import or breaks the contract, naming it.
    """
    cls: type[CustomOp] = catalog.load_resolved(entry)
    support = check_replacement(op, cls)
    if not support.ok:
        raise plugin_error(entry, support.reason)
    return cls


def _ask(entry: PluginEntry, cls: type[CustomOp], platform: PlatformInfo | None) -> Support:
    """``cls.is_supported(platform)``; everything runs its own code with the native key."""
    if platform is None:
        return Support.yes()
    try:
        answer = cls.is_supported(platform)
    except Exception as exc:
        raise plugin_error(entry, f"is_supported() raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(answer, Support):
        raise plugin_error(entry, f"is_supported() must return engine.sdk.Support, got "
                                  f"{answer!r}")
    return answer


def _eligible(candidate: OpCandidate) -> bool:
    return candidate.support is None or candidate.support.ok


def _rank(candidates: Sequence[OpCandidate]) -> list[OpCandidate]:
    """Eligible first, then by priority, then a third party's before the engine's own."""
    return sorted(candidates, key=lambda c: (
        not _eligible(c), -(c.priority or 0), c.entry.is_first_party,
        c.entry.distribution or "", c.entry.value))


def _tied(first: OpCandidate, other: OpCandidate) -> bool:
    return (_eligible(other) == _eligible(first) and other.priority == first.priority
            and other.entry.is_first_party == first.entry.is_first_party)


def _choose(op: str, ranked: list[OpCandidate], device: str) -> OpCandidate:
    """The first of ``ranked``; two third parties tied for first are the operator's call.

    Raises:
        PluginError: the tie, naming both and the items that choose.
    """
    first = ranked[0]
    tied = [c for c in ranked if _tied(first, c)]
    if len(tied) > 1 and not first.entry.is_first_party:
        choices = " or ".join(f"--custom-ops +{op}={c.entry.distribution or c.entry.value}"
                              for c in tied)
        raise PluginError(
            f"op {op!r} has {len(tied)} replacements of equal standing for the {device} "
            f"(priority {first.priority}, each with a path of its own): "
            f"{', '.join(c.label for c in tied)}. Choose one with {choices} (or -{op} for "
            f"the built-in), or keep one distribution with ENGINE_PLUGINS",
            plugin=op, group=CUSTOM_OPS)
    return first


def _default_reason(chosen: OpCandidate, ranked: list[OpCandidate], device: str) -> str:
    if len(ranked) == 1:
        return "no replacement is installed"
    eligible = _eligible(chosen)
    path = "" if device == NATIVE else f" with a {device} path"
    over = ", a third party's over the engine's" if not chosen.entry.is_first_party else ""
    head = (f"the only implementation{path}" if eligible and sum(map(_eligible, ranked)) == 1
        else f"ranks first{path} (priority {chosen.priority}{over})" if eligible
        else f"no implementation has a path of its own for {device}")
    return f"default: {head}"


def _passed_over(candidates: Sequence[OpCandidate]) -> tuple[str, ...]:
    return tuple(f"{c.label}: {c.support.reason}" for c in candidates
                 if c.support is not None and not c.support.ok)


def _decide(catalog: PluginCatalog, op: str, mode: _Mode, platform: PlatformInfo | None,
            device: str, measure: OpMeasure | None = None) -> CustomOpChoice:
    item = mode.item
    by = ("" if item is None else
          f"{item.source}: {item.text}" if item.source == OPERATOR
          else f"the {item.source}: {item.text}")
    entries = _entries(catalog, op)
    if mode.kind == "builtin":
        return CustomOpChoice(op, entries[0], by, (OpCandidate(entries[0]),))
    if mode.kind == "pick" and item is not None and item.choice is not None:
        picked = ([e for e in entries if e.distribution == item.choice]
                  or [catalog.resolve(CUSTOM_OPS, item.choice)])[0]
        cls = _load(catalog, op, picked)
        cand = OpCandidate(picked, cls.priority, _ask(picked, cls, platform))
        note = "" if cand.support is None or cand.support.ok else (
            f" (used although it says: {cand.support.reason})")
        return CustomOpChoice(op, picked, by + note, (cand,))
    candidates, classes = [], {}
    for entry in entries:
        cls = classes[entry] = _load(catalog, op, entry)
        candidates.append(OpCandidate(entry, cls.priority, _ask(entry, cls, platform)))
    eligible = [c for c in candidates if _eligible(c)]
    if mode.kind == "default" and measure is not None and len(eligible) > 1:
        fastest = measure(op, [(c.entry, classes[c.entry]) for c in eligible])
        if fastest is not None:
            return CustomOpChoice(op, fastest, "default: measured fastest here, of "
                                  f"{len(eligible)} with a path of their own",
                                  tuple(candidates), by_default=True,
                                  passed_over=_passed_over(candidates))
    pool = [c for c in candidates if not c.is_builtin] if mode.kind == "replace" else candidates
    ranked = _rank(pool)
    if mode.kind == "default" and not _eligible(ranked[0]):
        ranked = [candidates[0]]  # nothing can run here: the built-in (the reference)
    chosen = _choose(op, ranked, device)
    if mode.kind == "replace":
        return CustomOpChoice(op, chosen.entry, by, tuple(candidates))
    return CustomOpChoice(op, chosen.entry, _default_reason(chosen, _rank(candidates), device),
                          tuple(candidates), by_default=True,
                          passed_over=_passed_over(candidates))


def plan_custom_ops(catalog: PluginCatalog, settings: CustomOpSettings | None = None,
                    dispatch_key: str = NATIVE, platform: PlatformInfo | None = None, *,
                    strict: bool = True, measure: OpMeasure | None = None,
                    ) -> list[CustomOpChoice]:
    """Each built-in op's choice under ``settings`` (module docstring).

    Args:
        catalog: The plugins.
        settings: The items (default: none).
        dispatch_key: The device type the ops are built for; ``"native"`` (the
            reference everywhere) asks no ``is_supported``.
        platform: The device's info for ``is_supported`` (default: one made from
            ``dispatch_key``).
        strict: Raise the first failure (the worker); False: record it in the op's
            ``error`` and leave the built-in (``engine plugins list``).
        measure: Where given, an op no item names with several eligible implementations
            is built from the one ``measure`` finds fastest (ties and priorities aside).

    Raises:
        PluginError: (strict) an implementation that must be imported fails to, breaks
            its op's contract, or ties with another third party's.
    """
    settings = settings or CustomOpSettings()
    if platform is None and dispatch_key != NATIVE:
        platform = PlatformInfo(name=dispatch_key, device_type=dispatch_key)
    choices = []
    for op, mode in _modes(catalog, settings).items():
        try:
            choices.append(_decide(catalog, op, mode, platform, dispatch_key, measure))
        except PluginError as exc:
            if strict:
                raise
            choices.append(CustomOpChoice(op, builtin_entry(catalog, op), "not decided",
                                          error=str(exc)))
    return choices


def _unknown_replacements(catalog: PluginCatalog, settings: CustomOpSettings
                          ) -> list[PluginEntry]:
    """Allowed entries naming no built-in op that the settings would use."""
    unknown = [e for e in catalog.allowed(CUSTOM_OPS) if e.name not in BUILTIN_OPS]
    last_global = [item for item in settings.items() if item.op is None]
    if last_global and not last_global[-1].enable:
        return []  # ``none``: no replacement is used, known or not
    return unknown


def select_custom_ops(catalog: PluginCatalog, settings: CustomOpSettings | None = None,
                      dispatch_key: str = NATIVE, platform: PlatformInfo | None = None,
                      measure: OpMeasure | None = None,
                      ) -> dict[str, tuple[PluginEntry, type[CustomOp]]]:
    """The entry and class of every op that uses a replacement, imported and checked.

    Called: in each worker, once, while the model is built with ``dispatch_key`` (the
    platform's device type). Logs one INFO line saying what every op is built from.

    Raises:
        PluginError: an implementation that must be imported fails to or breaks its op's
            contract, two third parties tie for an op, or an entry is registered under a
            name that is no built-in op; each names the plugin and its distribution.
    """
    settings = settings or CustomOpSettings()
    for entry in _unknown_replacements(catalog, settings):
        raise plugin_error(entry, f"there is no built-in op named {entry.name!r} to replace; "
                                  f"ops: {', '.join(sorted(BUILTIN_OPS))}")
    choices = plan_custom_ops(catalog, settings, dispatch_key, platform, measure=measure)
    logger.info("custom ops: %s", "; ".join(
        f"{c.name} = {c.implementation} [{c.full_reason}]" for c in choices))
    return {c.name: (c.chosen, catalog.load_resolved(c.chosen)) for c in choices
            if c.use_replacement}


def describe_candidates(choice: CustomOpChoice) -> list[str]:
    """One line per candidate of ``choice``: its label, priority and eligibility."""
    lines = []
    for cand in choice.candidates:
        mark = "*" if cand.entry == choice.chosen else " "
        facts = [] if cand.priority is None else [f"priority {cand.priority}"]
        if cand.support is not None:
            facts.append("eligible" if cand.support.ok else f"not eligible: "
                                                           f"{cand.support.reason}")
        lines.append(f"{mark} {cand.label}" + (f"  ({'; '.join(facts)})" if facts else ""))
    return lines


__all__ = ["OPERATOR", "CustomOpChoice", "CustomOpItem", "CustomOpSettings", "OpCandidate",
           "OpMeasure",
           "builtin_entry", "describe_candidates", "parse_custom_op_items", "plan_custom_ops",
           "resolve_settings", "select_custom_ops"]
