"""The selected IO processor (``--io-processor``), run the same way offline and online.

``LLM.encode(data)`` and the server's ``POST /pooling`` share this::

    handle = load_io_processor(setup)                   # None without --io-processor
    parsed = handle.parse_request(data)                 # ValidationError: the client's (400)
    prompts = handle.pre_process(parsed, request_id, default_params)   # list[IOPrompt]
    ...generate every IOPrompt (its prompt, with its params), in any order...
    body = handle.post_process([generation_result(p.request_id, out) for ...], request_id)

Every hook runs through the handle, which owns the failure policy: a ``ValidationError``
passes through unchanged (the caller's mistake, named by its ``param``); any other
exception, and a result that breaks the contract (``pre_process`` returning no prompts or
something that is not a ``ProcessedPrompt``, a prompt with ``n != 1``), becomes a
``PluginError`` naming the processor, its group and distribution: that request fails, the
engine keeps serving.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.core.frontend.input_processor import PromptType
from engine.core.outputs import RequestOutput
from engine.core.plugin_construction import construct_plugin
from engine.core.plugins import PluginEntry
from engine.core.plugins._loader import plugin_error
from engine.core.startup import EngineSetup
from engine.sdk.errors import PluginError, ValidationError
from engine.sdk.groups import IO_PROCESSORS
from engine.sdk.io_processor import (
    GenerationResult,
    IOProcessor,
    IOProcessorContext,
    ProcessedPrompt,
)
from engine.sdk.plugin import PluginOptions
from engine.sdk.sampling_params import SamplingParams

T = TypeVar("T")


@dataclass(frozen=True)
class IOPrompt:
    """One prompt of an IO-processor request, ready for the engine.

    Attributes:
        request_id: The engine request id of this prompt (``<request id>-<index>``).
        prompt: Text, or ``{"prompt_token_ids": [...]}``.
        params: What to generate it with (the prompt's own, or the caller's default).
    """

    request_id: str
    prompt: PromptType
    params: SamplingParams


def generation_result(request_id: str, output: RequestOutput) -> GenerationResult:
    """The ``GenerationResult`` of a finished prompt (its one choice)."""
    choice = output.outputs[0]
    return GenerationResult(request_id=request_id, text=choice.text,
                            token_ids=tuple(choice.token_ids),
                            finish_reason=choice.finish_reason)


def io_processor_missing(setup: EngineSetup, how: str) -> str:
    """Why there is no IO processor, and ``how`` to select one (with the installed names)."""
    names = setup.catalog.names(IO_PROCESSORS)
    installed = ", ".join(names) if names else "none (a plugin registers one in " \
        "engine.io_processors)"
    return (f"no IO processor is selected: {how}, with NAME an engine.io_processors entry "
            f"or package.module:Class (installed: {installed})")


class IOProcessorHandle:
    """The constructed IO processor of one engine, with the failure policy around its hooks.

    Args:
        processor: The constructed plugin.
        entry: Its catalog entry (named in every error).
    """

    def __init__(self, processor: IOProcessor, entry: PluginEntry) -> None:
        self.processor = processor
        self.entry = entry

    @property
    def name(self) -> str:
        """The name the processor was selected under."""
        return self.entry.name

    def _call(self, hook: str, call: Callable[[], T]) -> T:
        try:
            return call()
        except ValidationError:
            raise
        except Exception as exc:
            raise self.error(f"{hook} raised {type(exc).__name__}: {exc}") from exc

    def error(self, cause: str) -> PluginError:
        """A ``PluginError`` naming this processor, its group and distribution."""
        return plugin_error(self.entry, cause)

    def parse_request(self, data: Any) -> Any:
        """``IOProcessor.parse_request(data)``.

        Raises:
            ValidationError: the payload is invalid (the processor's message and param).
            PluginError: the processor raised anything else.
        """
        return self._call("parse_request", lambda: self.processor.parse_request(data))

    def pre_process(self, request: Any, request_id: str,
                    default_params: SamplingParams) -> list[IOPrompt]:
        """``IOProcessor.pre_process``, checked, as engine prompts.

        Raises:
            ValidationError: the processor raised one.
            PluginError: the processor raised anything else, or returned no prompts,
                something that is not a ``ProcessedPrompt``, or a prompt with ``n != 1``.
        """
        made = self._call("pre_process", lambda: self.processor.pre_process(
            request, request_id=request_id))
        if isinstance(made, ProcessedPrompt) or not isinstance(made, Sequence) or not made:
            raise self.error(f"pre_process must return a non-empty sequence of "
                             f"ProcessedPrompt, got {made!r:.200}")
        prompts = []
        for index, prompt in enumerate(made):
            if not isinstance(prompt, ProcessedPrompt):
                raise self.error(f"pre_process returned {prompt!r:.200} at index {index}, "
                                 f"not an engine.sdk.ProcessedPrompt")
            params = prompt.sampling_params or default_params
            if params.n != 1:
                raise self.error(f"prompt {index} of pre_process asks for n={params.n}; "
                                 f"an IO processor gets one GenerationResult per prompt, so "
                                 f"n must be 1")
            engine_prompt: PromptType = (prompt.text if prompt.text is not None else
                                         {"prompt_token_ids": list(prompt.token_ids or ())})
            prompts.append(IOPrompt(f"{request_id}-{index}", engine_prompt, params))
        return prompts

    def invalid_prompt(self, prompt: IOPrompt, exc: ValidationError) -> ValidationError:
        """The engine refused a prompt the processor made (too long, bad token ids, ...)."""
        return ValidationError(f"{prompt.request_id}, a prompt IO processor {self.name!r} "
                               f"made from this payload, is invalid: {exc.message}",
                               param=exc.param)

    def post_process(self, results: Sequence[GenerationResult], request_id: str) -> Any:
        """``IOProcessor.post_process``: the response body.

        Raises:
            ValidationError: the processor raised one.
            PluginError: the processor raised anything else.
        """
        return self._call("post_process", lambda: self.processor.post_process(
            list(results), request_id=request_id))

    def json_body(self, body: Any) -> Any:
        """``body`` as JSON-ready data (a pydantic model is dumped).

        Raises:
            PluginError: ``post_process`` returned something JSON cannot encode.
        """
        if hasattr(body, "model_dump"):
            body = body.model_dump(mode="json")
        try:
            json.dumps(body, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise self.error(f"post_process returned a body JSON cannot encode "
                             f"({type(exc).__name__}: {exc})") from exc
        return body


def load_io_processor(setup: EngineSetup) -> IOProcessorHandle | None:
    """The processor ``--io-processor`` selects, constructed; ``None`` when none is.

    Called: once per front end, before EngineCore starts (a broken plugin stops start-up
    before any weights load).

    Raises:
        PluginError: the plugin is unknown, fails to load or to construct (its options
            included), naming it and its distribution.
    """
    name = setup.config.io_processor
    if name is None:
        return None
    catalog = setup.catalog
    entry = catalog.resolve(IO_PROCESSORS, name)
    cls = catalog.load(IO_PROCESSORS, name)

    def make(options: PluginOptions) -> IOProcessor:
        processor: IOProcessor = cls(IOProcessorContext(
            plugin_name=name, options=options, process="frontend",
            model=setup.source.display_name, max_model_len=setup.max_model_len))
        return processor

    return IOProcessorHandle(construct_plugin(setup, IO_PROCESSORS, name, cls, make), entry)


__all__ = ["IOPrompt", "IOProcessorHandle", "generation_result", "io_processor_missing",
           "load_io_processor"]
