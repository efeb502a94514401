"""``GET /load``: how many generation requests the server is handling (vLLM's route).

Answers ``{"server_load": N}``: the HTTP requests to :data:`TRACKED_PATHS` that arrived and
have not been answered yet, a stream counting until its last frame is sent. Load balancers
use it to pick the least busy replica. vLLM counts only with
``--enable-server-load-tracking`` (else it reports 0); here counting is always on (it costs
two integer updates per request), and that flag is accepted for compatibility.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.types import ASGIApp, Receive, Scope, Send

router = APIRouter()

#: The routes whose requests count as load (those that run the model).
TRACKED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/pooling"})


class ServerLoad:
    """The number of tracked requests in flight (kept on ``app.state.server_load``)."""

    def __init__(self) -> None:
        self.num_requests = 0


class ServerLoadMiddleware:
    """Count requests to :data:`TRACKED_PATHS` from arrival until the response ends."""

    def __init__(self, app: ASGIApp, load: ServerLoad) -> None:
        self.app = app
        self.load = load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in TRACKED_PATHS:
            await self.app(scope, receive, send)
            return
        self.load.num_requests += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.num_requests -= 1


@router.get("/load")
async def server_load(request: Request) -> dict[str, int]:
    """``{"server_load": N}``: generation requests in flight (see the module docstring)."""
    load: ServerLoad = request.app.state.server_load
    return {"server_load": load.num_requests}
