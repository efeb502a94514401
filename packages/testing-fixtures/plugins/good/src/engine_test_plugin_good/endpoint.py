"""An opt-in endpoint plugin: GET /test-echo/{word}."""

from __future__ import annotations

from typing import Any

from engine.sdk import EndpointPlugin


class EchoEndpoint(EndpointPlugin):
    """Adds one route that echoes its path parameter."""

    name = "test_good_echo"

    def attach_router(self, app: Any) -> None:
        from fastapi import APIRouter

        router = APIRouter()

        @router.get("/test-echo/{word}")
        async def echo(word: str) -> dict[str, str]:
            return {"word": word}

        app.include_router(router)
