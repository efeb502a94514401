"""``--api-key`` and ``--public-path``: which routes need the key.

With ``--api-key`` set, every route needs ``Authorization: Bearer KEY`` except the probes
(:data:`PROBE_PATHS`: ``/health`` and ``/ping``, which orchestrators call without
credentials) and the routes an operator opens with ``--public-path PATH`` (repeatable),
e.g. ``/metrics`` for a Prometheus scraper or ``/docs`` plus ``/openapi.json``.

That is stricter than vLLM, whose key covers ``/v1/*`` only: ``/tokenize``,
``/detokenize``, ``/metrics``, ``/docs``, ``/openapi.json``, ``/load``, ``/version``, the
dev and endpoint-plugin routes all cost CPU or say something about the traffic, so they are
closed unless opened. Without ``--api-key`` every route is open.

The key is checked on the headers, before the body is read: an unauthenticated client
cannot make the server read, parse or tokenize anything.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Iterable, Sequence

from starlette.routing import compile_path
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.server.errors import error_response

logger = logging.getLogger("engine.server")

#: Open without the key: health probes.
PROBE_PATHS = ("/health", "/ping")


class APIKeyMiddleware:
    """Refuse requests without ``Authorization: Bearer <api_key>`` with a 401.

    Open without it: :data:`PROBE_PATHS` and ``public_paths`` (route paths, templates such
    as ``/items/{name}`` included).
    """

    def __init__(self, app: ASGIApp, api_key: str, public_paths: Sequence[str] = ()) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        open_paths = (*PROBE_PATHS, *public_paths)
        self._exact = frozenset(p for p in open_paths if "{" not in p)
        self._patterns = [compile_path(p)[0] for p in open_paths if "{" in p]

    def is_public(self, path: str) -> bool:
        """Whether ``path`` is served without the key."""
        return path in self._exact or any(p.match(path) for p in self._patterns)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self.is_public(scope["path"]):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                response = error_response(
                    401, "invalid or missing API key: send 'Authorization: Bearer <key>' "
                    f"(without it only {', '.join(PROBE_PATHS)} and the --public-path routes "
                    "are served)", code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def check_public_paths(public_paths: Sequence[str], route_paths: Iterable[str], *,
                       has_api_key: bool) -> None:
    """Check every ``--public-path`` names a route the app serves.

    Raises:
        ValueError: a path that does not start with ``/`` or that no route serves (the
            message lists the routes).
    """
    served = sorted(set(route_paths))
    for path in public_paths:
        if not path.startswith("/"):
            raise ValueError(f"--public-path {path!r}: a path starts with '/', e.g. /metrics")
        if path not in served:
            raise ValueError(f"--public-path {path}: no route has this path (give it as "
                             f"listed, a template such as /items/{{name}} included); the "
                             f"routes are: {', '.join(served)}")
    if public_paths and not has_api_key:
        logger.warning("--public-path %s changes nothing: without --api-key every route is "
                       "open", " ".join(public_paths))
