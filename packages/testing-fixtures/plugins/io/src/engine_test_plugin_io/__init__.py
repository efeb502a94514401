"""IO processors that prove ``POST /pooling`` and ``LLM.encode`` reach them, and only them.

``test_io_prompts`` takes ``{"prompts": [text | [token ids], ...], "max_tokens": N}``,
generates every prompt greedily (its own ``sampling_params``: ``temperature=0``,
``ignore_eos``, ``max_tokens=N``) and answers ``{"processor", "request_id", "results":
[{"request_id", "text", "token_ids", "finish_reason"}, ...]}`` in prompt order. Its
``misbehave`` field makes it break on purpose, for the failure tests: ``raise_in_parse``,
``raise_in_pre``, ``raise_in_post`` (a ``RuntimeError`` in that hook), ``no_prompts``,
``not_a_prompt``, ``n_2`` (broken ``pre_process`` results), ``not_json`` (a
``post_process`` body JSON cannot encode).

``test_io_words`` (``{"text": "..."}`` -> ``{"words": N, "continuation": "..."}``, default
sampling parameters) exists to be installed and *not* selected: its counters stay at 0.

:data:`CALLS` counts every hook call as ``"<processor>.<hook>"``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any, cast

from pydantic import Field

from engine.sdk import (
    GenerationResult,
    IOProcessor,
    IOProcessorContext,
    PluginOptions,
    ProcessedPrompt,
    SamplingParams,
    ValidationError,
)

CALLS: Counter[str] = Counter()

MISBEHAVIOURS = ("raise_in_parse", "raise_in_pre", "raise_in_post", "no_prompts",
                 "not_a_prompt", "n_2", "not_json")


class PromptsProcessor(IOProcessor):
    """Greedy generation of a batch of prompts (see the module docstring)."""

    class Options(PluginOptions):
        max_prompts: int = Field(4, ge=1, description="most prompts in one request")

    def __init__(self, ctx: IOProcessorContext) -> None:
        super().__init__(ctx)
        self.options = cast(PromptsProcessor.Options, ctx.options)
        self._misbehave: dict[str, str] = {}
        CALLS["test_io_prompts.init"] += 1

    def parse_request(self, data: Any) -> dict[str, Any]:
        CALLS["test_io_prompts.parse_request"] += 1
        if not isinstance(data, dict):
            raise ValidationError('the body must be an object: {"prompts": [...]}',
                                  param="prompts")
        misbehave = data.get("misbehave")
        if misbehave is not None and misbehave not in MISBEHAVIOURS:
            raise ValidationError(f"misbehave must be one of {', '.join(MISBEHAVIOURS)}",
                                  param="misbehave")
        if misbehave == "raise_in_parse":
            raise RuntimeError("test_io_prompts fails in parse_request on purpose")
        prompts = data.get("prompts")
        if not isinstance(prompts, list) or not prompts:
            raise ValidationError("prompts must be a non-empty list", param="prompts")
        if len(prompts) > self.options.max_prompts:
            raise ValidationError(f"at most {self.options.max_prompts} prompts, got "
                                  f"{len(prompts)}", param="prompts")
        for i, prompt in enumerate(prompts):
            is_ids = isinstance(prompt, list) and prompt and all(
                type(t) is int for t in prompt)
            if not (isinstance(prompt, str) and prompt) and not is_ids:
                raise ValidationError(f"prompts[{i}] must be a non-empty string or list of "
                                      f"token ids", param=f"prompts[{i}]")
        max_tokens = data.get("max_tokens", 4)
        if type(max_tokens) is not int or not 1 <= max_tokens <= 64:
            raise ValidationError("max_tokens must be an integer in [1, 64]",
                                  param="max_tokens")
        return {"prompts": prompts, "max_tokens": max_tokens, "misbehave": misbehave}

    def pre_process(self, request: Any, request_id: str | None = None) -> Any:
        CALLS["test_io_prompts.pre_process"] += 1
        misbehave = request["misbehave"]
        if misbehave == "raise_in_pre":
            raise RuntimeError("test_io_prompts fails in pre_process on purpose")
        if misbehave == "no_prompts":
            return []
        if misbehave == "not_a_prompt":
            return ["Hello"]
        if misbehave in ("raise_in_post", "not_json") and request_id is not None:
            self._misbehave[request_id] = misbehave  # post_process sees only the id
        params = SamplingParams(temperature=0, max_tokens=request["max_tokens"],
                                ignore_eos=True, n=2 if misbehave == "n_2" else 1)
        return [ProcessedPrompt(text=p, sampling_params=params) if isinstance(p, str)
                else ProcessedPrompt(token_ids=tuple(p), sampling_params=params)
                for p in request["prompts"]]

    def post_process(self, results: Sequence[GenerationResult],
                     request_id: str | None = None) -> Any:
        CALLS["test_io_prompts.post_process"] += 1
        misbehave = self._misbehave.pop(request_id or "", None)
        if misbehave == "raise_in_post":
            raise RuntimeError("test_io_prompts fails in post_process on purpose")
        if misbehave == "not_json":
            return {"results": object()}
        return {"processor": "test_io_prompts", "request_id": request_id,
                "results": [{"request_id": r.request_id, "text": r.text,
                             "token_ids": list(r.token_ids), "finish_reason": r.finish_reason}
                            for r in results]}


class WordCountProcessor(IOProcessor):
    """Counts the words of a text and continues it (see the module docstring)."""

    def parse_request(self, data: Any) -> str:
        CALLS["test_io_words.parse_request"] += 1
        text = data.get("text") if isinstance(data, dict) else None
        if not isinstance(text, str) or not text.strip():
            raise ValidationError("text must be a non-empty string", param="text")
        return text

    def pre_process(self, request: Any, request_id: str | None = None) -> list[ProcessedPrompt]:
        CALLS["test_io_words.pre_process"] += 1
        return [ProcessedPrompt(text=request)]

    def post_process(self, results: Sequence[GenerationResult],
                     request_id: str | None = None) -> dict[str, Any]:
        CALLS["test_io_words.post_process"] += 1
        return {"words": len(results[0].text.split()), "continuation": results[0].text}
