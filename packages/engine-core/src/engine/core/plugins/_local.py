"""Plugin classes given as Python objects (``LLM(logits_processors=[MyProcessor])``).

A class that can be imported by its path (``module:QualName`` names the very same object)
becomes that path, and works wherever a name does, in every process. A class that cannot
(defined in ``__main__`` of a script, or inside a function) is registered here under a
reference that only this process can resolve; it works with EngineCore in this process
(``in_process=True``), and :func:`check_no_local_classes` stops a spawn of EngineCore's
own process with a message that says so.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

from engine.sdk.errors import ValidationError

#: Marks a reference that only this process can resolve.
LOCAL_MARK = "@local-"

_LOCAL: dict[str, type] = {}


def plugin_reference(value: Any) -> Any:
    """``value`` itself unless it is a class: then its import path or a local reference."""
    if not isinstance(value, type):
        return value
    path = f"{value.__module__}:{value.__qualname__}"
    if _imports_as(path, value):
        return path
    reference = f"{path}{LOCAL_MARK}{id(value):x}"
    _LOCAL[reference] = value
    return reference


def _imports_as(path: str, cls: type) -> bool:
    module_name, _, qualname = path.partition(":")
    if module_name == "__main__" or "<locals>" in qualname:
        return False
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except Exception:  # noqa: BLE001 - not importable by path, for whatever reason
        return False
    return obj is cls


def local_class(reference: str) -> type | None:
    """The class registered under ``reference`` in this process, if any."""
    return _LOCAL.get(reference) if LOCAL_MARK in reference else None


def check_no_local_classes(references: Iterable[str]) -> None:
    """Refuse to hand EngineCore's own process a class it cannot import.

    ``references`` are the config's plugin selections (``EngineConfig.plugin_selections``).

    Raises:
        ValidationError: naming the class, why, and the two ways out.
    """
    local = [r for r in references if LOCAL_MARK in r]
    if local:
        names = ", ".join(r.partition(LOCAL_MARK)[0] for r in local)
        raise ValidationError(
            f"{names}: a plugin class defined in __main__ or inside a function cannot be "
            f"imported by EngineCore's process. Move it into an importable module, or run "
            f"EngineCore in this process (LLM(..., in_process=True), "
            f"AsyncLLM(..., client=in_process_client)).", param="plugins")
