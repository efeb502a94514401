"""``engine.endpoints`` entry ``acme_generate`` (opt-in): ``POST /acme/v1/generate``.

The simplest text API: ``{"prompt": "...", "max_tokens": 16, "temperature": 0}`` ->
``{"text", "token_ids", "finish_reason"}``, served by the engine client the server hands
the plugin (``AsyncLLM.generate``). Answers 503 until the engine is ready, 400 for a bad
body. Enable it with ``ENGINE_PLUGINS=acme-engine-plugins`` (or
``endpoints:acme_generate``).
"""

from __future__ import annotations

import uuid
from typing import Any

from engine.sdk import EndpointPlugin, SamplingParams


class SimpleGenerateEndpoint(EndpointPlugin):
    """Adds ``POST /acme/v1/generate``."""

    name = "acme_generate"

    def __init__(self) -> None:
        self.client: Any = None

    def attach_router(self, app: Any) -> None:
        from fastapi import APIRouter
        from fastapi.responses import JSONResponse

        router = APIRouter()

        @router.post("/acme/v1/generate")
        async def generate(body: dict[str, Any]) -> JSONResponse:
            if self.client is None:
                return JSONResponse({"error": "the engine is not ready"}, status_code=503)
            prompt, error = body.get("prompt"), _check(body)
            if error is not None:
                return JSONResponse({"error": error}, status_code=400)
            params = SamplingParams(max_tokens=body.get("max_tokens", 16),
                                    temperature=body.get("temperature", 0.0))
            final = None
            async for output in self.client.generate(f"acme-{uuid.uuid4().hex}", prompt,
                                                     params):
                final = output  # cumulative: the last one holds everything
            if final is None:
                return JSONResponse({"error": "the engine returned nothing"}, status_code=500)
            completion = final.outputs[0]
            return JSONResponse({"text": completion.text,
                                 "token_ids": list(completion.token_ids),
                                 "finish_reason": completion.finish_reason})

        app.include_router(router)

    async def init_state(self, client: Any, state: Any) -> None:
        self.client = client


def _check(body: dict[str, Any]) -> str | None:
    """What is wrong with the request body, or None."""
    if not isinstance(body.get("prompt"), str) or not body["prompt"]:
        return "prompt must be a non-empty string"
    max_tokens = body.get("max_tokens", 16)
    if type(max_tokens) is not int or not 1 <= max_tokens <= 4096:
        return f"max_tokens must be an integer in [1, 4096], got {max_tokens!r}"
    temperature = body.get("temperature", 0.0)
    if type(temperature) not in (int, float) or temperature < 0:
        return f"temperature must be a number >= 0, got {temperature!r}"
    return None
