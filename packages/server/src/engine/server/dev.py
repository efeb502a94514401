r"""Development endpoints, mounted only with ``engine serve --enable-dev-endpoints``.

``POST /collective_rpc`` calls a worker-extension method on every worker, as vLLM's dev
mode does::

    curl -s localhost:8000/collective_rpc -H 'Content-Type: application/json' \\
      -d '{"method": "weight_norm", "args": [], "kwargs": {}, "timeout": 10}'
    {"results": [12.5, 12.5]}

It reaches into the workers, so it is off by default, and behind ``--api-key`` when one is
set. A failure on a worker is a 400 naming the rank and the extension; the engine keeps
serving.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from engine.core.messages import CollectiveRpcError
from engine.server.errors import APIError
from engine.server.state import server_state

router = APIRouter()

#: Paths this module serves (``--api-key`` protects them like ``/v1/*``).
PATHS = ("/collective_rpc",)


class CollectiveRpcBody(BaseModel):
    """The body of ``POST /collective_rpc``."""

    model_config = ConfigDict(extra="forbid")

    method: str = Field(min_length=1, description="a method of a selected worker extension")
    args: list[Any] = Field(default_factory=list, description="positional arguments")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments")
    timeout: float | None = Field(None, gt=0, description="seconds to wait for every rank")


@router.post("/collective_rpc")
async def collective_rpc(body: CollectiveRpcBody, request: Request) -> dict[str, Any]:
    """One result per worker rank, in rank order."""
    engine = server_state(request).engine
    try:
        results = await engine.collective_rpc(body.method, body.args, body.kwargs,
                                              body.timeout)
    except CollectiveRpcError as exc:
        raise APIError(400, str(exc), param="method", code="collective_rpc_failed") from exc
    return {"results": results}
