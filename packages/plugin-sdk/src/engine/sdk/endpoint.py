"""``EndpointPlugin``: add HTTP routes to the server (opt-in, routes only).

Endpoint plugins open routes, so they are never loaded unless the operator names them in
``ENGINE_PLUGINS`` / ``--plugins``. A plugin reaches the engine only through the public
client passed to :meth:`EndpointPlugin.init_state`, never through engine internals. A route
whose method and path clash with a built-in or another plugin's route stops start-up with
an error naming both.

The entry value in ``engine.endpoints`` is a factory: a zero-argument callable (usually the
class itself) returning an :class:`EndpointPlugin`.

.. versionadded:: 1.0
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from engine.sdk.plugin import Plugin


class EndpointPlugin(Plugin, ABC):
    """A set of routes attached to the server's FastAPI app.

    Example::

        class Echo(EndpointPlugin):
            name = "echo"

            def attach_router(self, app):
                router = fastapi.APIRouter()

                @router.get("/echo/{word}")
                async def echo(word: str):
                    return {"word": word}

                app.include_router(router)

    .. versionadded:: 1.0
    """

    name: ClassVar[str]

    @abstractmethod
    def attach_router(self, app: Any) -> None:
        """Add routes to ``app`` (a ``fastapi.FastAPI``).

        Called: once, in the front end, before the server starts listening.
        Must: only add routes (no middleware, no changes to existing routes).
        """

    async def init_state(self, client: Any, state: Any) -> None:
        """Keep what the routes need: ``client`` is the engine client, ``state`` the app state.

        Called: once, in the front end, after the engine is ready. Default: no-op.
        """
