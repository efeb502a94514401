"""The choices ``engine plugins list`` shows: each custom op's and each model's candidates.

Where several distributions provide one op or architecture, all of them are candidates
(``engine.core.custom_op_selection``, ``engine.core.model_selection``); this module says
which one an engine started here would use and why. Custom ops are decided on this host's
platform, with each candidate imported and asked ``is_supported`` as the worker would; a
candidate that fails to import, or a tie the operator must break, is shown on the op's
line instead of failing the listing.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.core.model_selection import choose_model
from engine.core.plugins import PluginCatalog
from engine.sdk.errors import PluginError, ValidationError
from engine.sdk.groups import CUSTOM_OPS, MODELS

if TYPE_CHECKING:
    from engine.core.custom_op_selection import CustomOpChoice


@dataclass(frozen=True)
class OpPlan:
    """The custom ops' choices on ``device``."""

    device: str
    choices: list[CustomOpChoice]


def plan_ops(catalog: PluginCatalog, items: str) -> OpPlan | None:
    """Each op's choice under ``--custom-ops items`` on this host (None: bad items, printed)."""
    # Imported here: torch, and the platform's detectors.
    from engine.core.custom_op_selection import CustomOpSettings, plan_custom_ops
    from engine.core.platforms import select_platform

    settings = CustomOpSettings(operator=tuple(i for i in items.split(",") if i))
    try:
        settings.validate(catalog)
        platform = select_platform(catalog)
    except (ValidationError, PluginError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None
    info = platform.info()
    choices = plan_custom_ops(catalog, settings, info.device_type, info, strict=False)
    return OpPlan(info.device_type, choices)


def mark_op_rows(rows: list[dict[str, Any]], plan: OpPlan) -> None:
    """Add ``used`` / ``used_reason`` to the ``engine.custom_ops`` rows (``--json``)."""
    by_name = {c.name: c for c in plan.choices}
    for row in rows:
        if row["group"] != CUSTOM_OPS:
            continue
        choice = by_name.get(row["name"])
        row["used"] = bool(choice is not None and row["allowed"] and choice.error is None
                           and choice.chosen.value == row["value"]
                           and choice.chosen.distribution == row["distribution"])
        row["used_reason"] = (choice.error or choice.full_reason if choice is not None and
                              row["allowed"] else "not allowed" if not row["allowed"] else
                              "no built-in op has this name")


def print_ops(plan: OpPlan) -> None:
    """The custom-op section: one line per op, then its candidates."""
    from engine.core.custom_op_selection import describe_candidates

    print(f"custom ops on {plan.device}  (chosen in each worker: the platform's custom_ops "
          f"apply first, then --custom-ops, which wins; * marks the one used)")
    for choice in plan.choices:
        if choice.error is not None:
            print(f"  {choice.name} = not decided: {choice.error}")
            continue
        print(f"  {choice.name} = {choice.implementation}  [{choice.reason}]")
        if len(choice.candidates) > 1:
            for line in describe_candidates(choice):
                print(f"    {line}")


def print_models(catalog: PluginCatalog, model_impl: str) -> None:
    """One line per architecture that several allowed models serve, with the one used."""
    shared = [name for name in catalog.names(MODELS) if len(catalog.candidates(MODELS, name)) > 1]
    if not shared:
        return
    print(f"models served by several implementations  (--model-impl {model_impl})")
    for arch in shared:
        try:
            choice = choose_model(catalog, [arch], model_impl)
            print(f"  {arch} = {choice.entry.value} ({choice.entry.provider})  "
                  f"[{choice.reason}]")
        except (PluginError, ValidationError) as exc:
            print(f"  {arch} = not decided: {exc}")
        for entry in catalog.candidates(MODELS, arch):
            print(f"      {entry.value} ({entry.provider})")


__all__ = ["OpPlan", "mark_op_rows", "plan_ops", "print_models", "print_ops"]
