"""``IOProcessor``: turn custom request payloads into prompts and outputs into responses.

.. versionadded:: 1.0
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.sdk.context import PluginContext
from engine.sdk.plugin import Plugin
from engine.sdk.sampling_params import SamplingParams


@dataclass(frozen=True)
class ProcessedPrompt:
    """A prompt produced by :meth:`IOProcessor.pre_process`: text or token ids, not both.

    Attributes:
        text: The prompt as text (tokenized by the engine).
        token_ids: The prompt as token ids.
        sampling_params: How to generate for this prompt (``n`` must be 1: one
            :class:`GenerationResult` per prompt). ``None``: the caller's default, which is
            the ``sampling_params`` argument of ``LLM.encode`` offline and
            ``SamplingParams()`` (vLLM's defaults) on ``POST /pooling``.

    .. versionadded:: 1.0
    .. versionchanged:: 1.1 Added ``sampling_params``.
    """

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    sampling_params: SamplingParams | None = None

    def __post_init__(self) -> None:
        if (self.text is None) == (self.token_ids is None):
            raise ValueError("ProcessedPrompt needs exactly one of text or token_ids")


@dataclass(frozen=True)
class GenerationResult:
    """One finished generation handed to :meth:`IOProcessor.post_process`.

    .. versionadded:: 1.0
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None


@dataclass(frozen=True, kw_only=True)
class IOProcessorContext(PluginContext):
    """What an IO processor is told. ``max_model_len``: longest sequence served.

    .. versionadded:: 1.0
    """

    max_model_len: int = 0


class IOProcessor(Plugin, ABC):
    """Custom input/output handling selected with ``--io-processor NAME`` (front end only).

    The engine serves the selected processor on ``POST /pooling`` (``engine serve
    --io-processor NAME``) and offline through ``LLM.encode(data)``: the payload goes
    through :meth:`parse_request`, :meth:`pre_process`, the engine (one generation per
    prompt) and :meth:`post_process`, whose return value is the response. An exception
    other than ``ValidationError`` raised by a hook fails that request only, with a
    ``PluginError`` naming the plugin and its distribution (HTTP 500, code
    ``plugin_error``).

    .. versionadded:: 1.0
    """

    def __init__(self, ctx: IOProcessorContext) -> None:
        self.ctx = ctx

    def parse_request(self, data: Any) -> Any:
        """Validate the raw request payload; raise ``ValidationError`` (-> HTTP 400).

        Called: once per request in the front end, before ``pre_process``. Default: returns
        ``data`` unchanged.
        """
        return data

    @abstractmethod
    def pre_process(self, request: Any, request_id: str | None = None) -> Sequence[ProcessedPrompt]:
        """Turn a parsed request into one or more prompts.

        Called: once per request in the front end.
        """

    @abstractmethod
    def post_process(
        self, results: Sequence[GenerationResult], request_id: str | None = None
    ) -> Any:
        """Turn the finished generations (one per prompt, same order) into the response body.

        Called: once per request in the front end, after every prompt finished.
        """
