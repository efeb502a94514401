"""Package attributes imported on first use (PEP 562), for packages with light submodules."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_attributes(package: str, sources: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``name`` from ``sources[name]`` when first read.

    Example (in a package's ``__init__.py``)::

        __getattr__ = lazy_attributes(__name__, {"LLM": "engine.core.llm"})
    """
    def __getattr__(name: str) -> Any:
        source = sources.get(name)
        if source is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(source), name)
        setattr(sys.modules[package], name, value)  # later reads skip this function
        return value

    return __getattr__
