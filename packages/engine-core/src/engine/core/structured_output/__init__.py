"""Structured outputs: the EngineCore manager, the worker's bitmask step, the xgrammar backend.

See :mod:`engine.sdk.structured_output` for the contract and ``docs/plugins/
structured-outputs.md`` for the guide.
"""

from engine.core.structured_output.manager import (
    StructuredOutputManager,
    build_backend,
    frontend_validator,
    load_backend_class,
)

__all__ = ["StructuredOutputManager", "build_backend", "frontend_validator", "load_backend_class"]
