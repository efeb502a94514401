"""IO-processor plugin: a batch of texts or token-id lists in, one result per item out.

Request body::

    {"items": ["a text", [1, 2, 3], ...]}

Each item becomes one prompt (``Options.prefix`` is put before texts); the response is
``{"request_id": ..., "outputs": [{"index", "text", "num_tokens", "finish_reason"}, ...]}``
in the order of the items.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import Field

from engine.sdk import (
    GenerationResult,
    IOProcessor,
    IOProcessorContext,
    PluginOptions,
    ProcessedPrompt,
    ValidationError,
)
from engine_test_plugin_sdk1.counters import count


class Sdk1BatchProcessor(IOProcessor):
    class Options(PluginOptions):
        prefix: str = Field("", description="text put before every text item")
        max_items: int = Field(8, ge=1, description="most items in one request")

    def __init__(self, ctx: IOProcessorContext) -> None:
        super().__init__(ctx)
        options = ctx.options
        if not isinstance(options, Sdk1BatchProcessor.Options):
            options = Sdk1BatchProcessor.Options()  # built outside the engine
        self.options = options

    def parse_request(self, data: Any) -> list[str | tuple[int, ...]]:
        count("sdk1_batch.parse_request")
        items = data.get("items") if isinstance(data, dict) else None
        if not isinstance(items, list) or not items:
            raise ValidationError('the body must be {"items": [...]} with at least one item',
                                  param="items")
        if len(items) > self.options.max_items:
            raise ValidationError(f"at most {self.options.max_items} items are accepted, got "
                                  f"{len(items)}", param="items")
        parsed: list[str | tuple[int, ...]] = []
        for i, item in enumerate(items):
            if isinstance(item, str) and item:
                parsed.append(item)
            elif (isinstance(item, list) and item
                  and all(type(t) is int and t >= 0 for t in item)):
                if self.ctx.max_model_len and len(item) >= self.ctx.max_model_len:
                    raise ValidationError(
                        f"items[{i}] has {len(item)} tokens; fewer than max_model_len="
                        f"{self.ctx.max_model_len} are accepted", param=f"items[{i}]")
                parsed.append(tuple(item))
            else:
                raise ValidationError(f"items[{i}] must be a non-empty string or a non-empty "
                                      f"list of token ids, got {item!r}", param=f"items[{i}]")
        return parsed

    def pre_process(self, request: Any, request_id: str | None = None) -> list[ProcessedPrompt]:
        count("sdk1_batch.pre_process")
        return [ProcessedPrompt(text=self.options.prefix + item) if isinstance(item, str)
                else ProcessedPrompt(token_ids=tuple(item)) for item in request]

    def post_process(
        self, results: Sequence[GenerationResult], request_id: str | None = None
    ) -> dict[str, Any]:
        count("sdk1_batch.post_process")
        return {"request_id": request_id, "outputs": [
            {"index": i, "text": r.text, "num_tokens": len(r.token_ids),
             "finish_reason": r.finish_reason} for i, r in enumerate(results)]}
