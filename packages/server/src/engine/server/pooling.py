"""``POST /pooling``: the selected IO processor (``--io-processor NAME``), as vLLM serves it.

The JSON body is the processor's own payload. It goes through ``parse_request`` ->
``pre_process`` -> the engine (one generation per ``ProcessedPrompt``, with its
``sampling_params`` or vLLM's defaults, all prompts concurrently) -> ``post_process``,
whose return value is the response body (200)::

    curl -s localhost:8000/pooling -d '{"items": ["Hello", [7, 11, 13]]}'

Errors: a ``ValidationError`` from the processor, or a prompt the engine refuses, is a 400
naming the field (``param``); anything else the processor raises, or a result that breaks
its contract, is a 500 with code ``plugin_error`` naming the plugin and its distribution
(that request only; the server keeps serving). Without ``--io-processor`` the route
answers 404 saying how to enable it. ``--api-key`` protects it as it protects ``/v1/*``.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from engine.core.client.request_stream import RequestStream
from engine.core.io_processing import IOProcessorHandle, generation_result, io_processor_missing
from engine.sdk.errors import ValidationError
from engine.sdk.sampling_params import SamplingParams
from engine.server.errors import APIError
from engine.server.protocol import surrogate_in
from engine.server.state import ServerState, random_id, server_state
from engine.server.streaming import (
    ClientDisconnected,
    cancel_on_disconnect,
    close_all,
    collect_final,
)

router = APIRouter()

#: The route, for the API-key middleware.
PATH = "/pooling"


def _handle(state: ServerState) -> IOProcessorHandle:
    handle = state.io_processor
    if handle is None:
        raise APIError(404, f"POST {PATH} serves an IO processor, and this server runs none. "
                       + io_processor_missing(state.engine.setup,
                                              "start it with engine serve --io-processor NAME"),
                       code="io_processor_not_enabled")
    return handle


async def _json_body(request: Request) -> Any:
    """The body as JSON; every string in it valid Unicode (as for the other routes)."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise ValidationError(f"malformed JSON body: {exc}") from None
    except RecursionError:
        raise ValidationError("malformed JSON body: arrays or objects are nested too "
                              "deeply") from None
    problem = surrogate_in(data)
    if problem is not None:
        raise ValidationError(f"body: {problem}")
    return data


@router.post(PATH, response_model=None)
async def pooling(request: Request) -> Response:
    """Run the body through the IO processor and the engine (see the module docstring)."""
    state = server_state(request)
    handle = _handle(state)
    data = await _json_body(request)
    request_id = random_id("pool")
    prompts = handle.pre_process(handle.parse_request(data), request_id, SamplingParams())
    streams: list[RequestStream] = []
    try:
        for prompt in prompts:  # all or none: an invalid prompt aborts the queued ones
            try:
                streams.append(await state.engine.add_request_async(
                    prompt.request_id, prompt.prompt, prompt.params))
            except ValidationError as exc:
                raise handle.invalid_prompt(prompt, exc) from None
        outputs = await cancel_on_disconnect(request, collect_final(streams))
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        close_all(streams)
    body = handle.post_process(
        [generation_result(p.request_id, o) for p, o in zip(prompts, outputs, strict=True)],
        request_id)
    return JSONResponse(handle.json_body(body))
