"""The engine core: ``LLM`` for offline use, and the pieces behind it.

The names below are imported on first use (PEP 562), so importing a light submodule such
as ``engine.core.config`` (the command line does, before it starts EngineCore) does not
pull in torch and transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.core._lazy import lazy_attributes
from engine.core._version import __version__

if TYPE_CHECKING:
    from engine.core.config import EngineConfig
    from engine.core.llm import LLM
    from engine.core.outputs import CompletionOutput, Logprob, RequestOutput
    from engine.sdk.sampling_params import SamplingParams

__all__ = [
    "__version__",
    "LLM",
    "SamplingParams",
    "EngineConfig",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
]

_LAZY = {
    "LLM": "engine.core.llm",
    "SamplingParams": "engine.sdk.sampling_params",
    "EngineConfig": "engine.core.config",
    "RequestOutput": "engine.core.outputs",
    "CompletionOutput": "engine.core.outputs",
    "Logprob": "engine.core.outputs",
}


__getattr__ = lazy_attributes(__name__, _LAZY)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
