"""Endpoint plugins (``engine.endpoints``): opt-in routes attached to the app.

An endpoint plugin is loaded only when the allowlist names it (``--plugins`` or
``ENGINE_PLUGINS``). Its factory is called, then ``attach_router(app)``; every route it
adds is checked against the routes already there: a method and path that exist already
(a built-in route or another plugin's) stop start-up with an error naming both. Once the
engine is ready, ``init_state(engine, app.state)`` is awaited.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import fastapi.routing
from fastapi import FastAPI
from starlette.routing import BaseRoute

from engine.core.plugins import PluginCatalog
from engine.sdk.endpoint import EndpointPlugin
from engine.sdk.errors import PluginError
from engine.sdk.groups import ENDPOINTS

logger = logging.getLogger("engine.server")


@dataclass(frozen=True)
class LoadedEndpoint:
    """An attached endpoint plugin."""

    name: str
    provider: str
    plugin: EndpointPlugin


def _flatten(routes: Sequence[BaseRoute]) -> Iterator[tuple[str | None, Any, str | None]]:
    """``(path, methods, name)`` of every route, included routers opened up."""
    iter_route_contexts = getattr(fastapi.routing, "iter_route_contexts", None)
    if iter_route_contexts is None:  # FastAPI < 0.130 copies included routes into the app
        for route in routes:
            yield getattr(route, "path", None), getattr(route, "methods", None), getattr(
                route, "name", None)
        return
    for context in iter_route_contexts(routes):
        yield context.path, context.methods, context.name


def route_keys(routes: Sequence[BaseRoute]) -> dict[tuple[str, str], str]:
    """``(METHOD, path) -> route name`` for every HTTP route."""
    keys: dict[tuple[str, str], str] = {}
    for path, methods, name in _flatten(routes):
        if path is None or not methods:
            continue
        for method in sorted(methods):
            keys.setdefault((method, path), name or "?")
    return keys


def attach_endpoint(app: FastAPI, name: str, plugin: EndpointPlugin,
                    owners: dict[tuple[str, str], str], label: str | None = None) -> None:
    """Let ``plugin`` add its routes; ``owners`` maps existing routes to who added them.

    The plugin's routes are added to ``owners`` under ``label`` (default: its name).

    Raises:
        PluginError: a new route clashes with an existing one (naming both owners), or the
            plugin removed routes.
    """
    before = list(app.router.routes)
    plugin.attach_router(app)
    after = list(app.router.routes)
    if any(route not in after for route in before):
        raise PluginError("attach_router removed or replaced existing routes; an endpoint "
                          "plugin may only add routes", plugin=name, group=ENDPOINTS)
    added = [route for route in after if route not in before]
    for key in route_keys(added):
        if key in owners:
            method, path = key
            raise PluginError(f"its route {method} {path} clashes with the same route of "
                              f"{owners[key]}", plugin=name, group=ENDPOINTS)
        owners[key] = label or f"endpoint plugin {name!r}"


def attach_endpoint_plugins(app: FastAPI, catalog: PluginCatalog) -> list[LoadedEndpoint]:
    """Load every allowed ``engine.endpoints`` plugin and attach its routes.

    Raises:
        PluginError: a plugin failed to load or construct, or its routes clash; the message
            names the plugin and its distribution.
    """
    owners = {key: f"the built-in route {name!r}"
              for key, name in route_keys(app.router.routes).items()}
    loaded = []
    for name in catalog.names(ENDPOINTS):
        entry = catalog.resolve(ENDPOINTS, name)
        factory = catalog.load(ENDPOINTS, name)
        try:
            plugin = factory()
        except Exception as exc:
            raise catalog.error(ENDPOINTS, name, f"its factory raised {type(exc).__name__}: "
                                f"{exc}") from exc
        if not isinstance(plugin, EndpointPlugin):
            raise catalog.error(ENDPOINTS, name, f"its factory returned "
                                f"{type(plugin).__name__}, not an EndpointPlugin")
        try:
            attach_endpoint(app, name, plugin, owners,
                            f"endpoint plugin {name!r} (distribution {entry.provider})")
        except PluginError as exc:
            raise catalog.error(ENDPOINTS, name, exc.cause) from exc
        loaded.append(LoadedEndpoint(name, entry.provider, plugin))
        logger.info("endpoint plugin %r (%s) attached", name, entry.provider)
    return loaded


async def init_endpoint_states(loaded: Iterable[LoadedEndpoint], engine: Any,
                               state: Any) -> None:
    """Await every plugin's ``init_state`` (after the engine is ready)."""
    for endpoint in loaded:
        try:
            await endpoint.plugin.init_state(engine, state)
        except Exception as exc:
            raise PluginError(f"init_state raised {type(exc).__name__}: {exc}",
                              plugin=endpoint.name, group=ENDPOINTS,
                              distribution=endpoint.provider) from exc
