"""``engine.io_processors`` entry ``acme_classify``: label texts with the model, one call.

``POST /pooling`` (or ``LLM.encode``) with ``{"texts": ["...", ...], "labels": ["spam",
"ham"]}`` answers ``{"labels": [one label per text]}``: each text becomes one prompt
(``prompt_template``), generated greedily under a structured-output ``choice`` of the
labels, so every answer is one of them.
"""

from __future__ import annotations

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
from engine.sdk.structured_output import StructuredOutputsParams


class Classifier(IOProcessor):
    """``{"texts", "labels"}`` -> one constrained, greedy generation per text -> labels."""

    class Options(PluginOptions):
        prompt_template: str = Field("Text: {text}\nLabel:", description="{text} is replaced")
        max_texts: int = Field(64, ge=1, description="most texts in one request")

    def __init__(self, ctx: IOProcessorContext) -> None:
        super().__init__(ctx)
        self.options = cast(Classifier.Options, ctx.options)

    def parse_request(self, data: Any) -> tuple[list[str], list[str]]:
        if not isinstance(data, dict):
            raise ValidationError('the body must be {"texts": [...], "labels": [...]}')
        texts, labels = _strings(data, "texts"), _strings(data, "labels")
        if len(texts) > self.options.max_texts:
            raise ValidationError(f"texts has {len(texts)} items; at most "
                                  f"{self.options.max_texts} are accepted", param="texts")
        if len(set(labels)) < 2:
            raise ValidationError("labels must hold at least two different labels",
                                  param="labels")
        return texts, labels

    def pre_process(self, request: Any, request_id: str | None = None) -> list[ProcessedPrompt]:
        texts, labels = request
        params = SamplingParams(temperature=0, max_tokens=max(len(x) for x in labels) * 4,
                                structured_outputs=StructuredOutputsParams(choice=tuple(labels)))
        return [ProcessedPrompt(text=self.options.prompt_template.format(text=text),
                                sampling_params=params) for text in texts]

    def post_process(self, results: Sequence[GenerationResult],
                     request_id: str | None = None) -> dict[str, Any]:
        return {"labels": [result.text for result in results]}


def _strings(data: dict[str, Any], field: str) -> list[str]:
    """``data[field]``, which must be a non-empty list of non-empty strings."""
    values = data.get(field)
    if not isinstance(values, list) or not values or not all(
            isinstance(v, str) and v for v in values):
        raise ValidationError(f"{field} must be a non-empty list of non-empty strings",
                              param=field)
    return values
