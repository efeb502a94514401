"""``GET /v1/models``, ``GET /health``, ``GET``/``POST /ping`` and ``GET /version``.

``/health`` and ``/ping`` (vLLM's name for the same probe, e.g. for SageMaker) answer from
the event loop without waiting for any request's work, and stay open under ``--api-key``.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.core import __version__
from engine.sdk._version import __version__ as sdk_version
from engine.server.errors import error_response
from engine.server.state import server_state

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    """The served model, under each of its names."""
    state = server_state(request)
    engine = state.engine
    cards = [{"id": name, "object": "model", "created": state.created, "owned_by": "engine",
              "root": engine.setup.source.display_name, "parent": None,
              "max_model_len": engine.max_model_len} for name in state.model_names]
    return {"object": "list", "data": cards}


@router.get("/health", response_model=None)
async def health(request: Request) -> Response:
    """200 while the engine serves; 503 with the reason once it is dead."""
    engine = server_state(request).engine
    if await engine.is_healthy():
        return Response(status_code=200)
    reason = engine.dead_error or "EngineCore is not running"
    return error_response(503, f"the engine is not available: {reason}",
                          code="engine_unavailable")


@router.get("/ping", response_model=None)
async def ping(request: Request) -> Response:
    """The same answer as ``GET /health`` (vLLM's ``/ping``)."""
    return await health(request)


@router.post("/ping", response_model=None)
async def ping_post(request: Request) -> Response:
    """The same answer as ``GET /health`` (vLLM also serves ``POST /ping``)."""
    return await health(request)


@router.get("/version")
async def version() -> dict[str, str]:
    """The engine's version (and the plugin SDK's)."""
    return {"version": __version__, "sdk_version": sdk_version}
