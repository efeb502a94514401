"""Endpoint plugin (opt-in): ``GET /sdk1/status`` and ``GET /sdk1/stats``.

``/sdk1/status`` answers 503 until ``init_state`` ran (the engine is ready), then 200;
``/sdk1/stats`` serves the totals of this distribution's stat logger. Routes only, under
a prefix of its own; it does not call into the engine client it is handed.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

from engine.sdk import EndpointPlugin, __version__
from engine_test_plugin_sdk1.counters import count


class Sdk1StatusEndpoint(EndpointPlugin):
    name: ClassVar[str] = "sdk1_status"

    def __init__(self) -> None:
        self.ready_since: float | None = None
        self.num_requests = 0

    def attach_router(self, app: Any) -> None:
        from fastapi import APIRouter
        from fastapi.responses import JSONResponse

        count("sdk1_status.attach_router")
        router = APIRouter()

        @router.get("/sdk1/status")
        async def status() -> JSONResponse:
            self.num_requests += 1
            ready = self.ready_since is not None
            body = {"plugin": self.name, "ready": ready, "ready_since": self.ready_since,
                    "requests": self.num_requests, "sdk_version": __version__}
            return JSONResponse(body, status_code=200 if ready else 503)

        @router.get("/sdk1/stats")
        async def stats() -> dict[str, Any]:
            from engine_test_plugin_sdk1.stats import RECENT, TOTALS

            self.num_requests += 1
            return {**TOTALS, "recent": [list(item) for item in RECENT]}

        app.include_router(router)

    async def init_state(self, client: Any, state: Any) -> None:
        count("sdk1_status.init_state")
        self.ready_since = time.time()
