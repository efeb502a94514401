"""The engine core: ``LLM`` for offline use, and the pieces behind it."""

from engine.core._version import __version__
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
