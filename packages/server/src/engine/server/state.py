"""What the routes share: the engine, the server's options, and request helpers."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from engine.core.client.async_llm import AsyncLLM
from engine.core.io_processing import IOProcessorHandle
from engine.server.errors import APIError
from engine.server.limits import DEFAULT_MAX_REQUEST_BYTES
from engine.server.tools import ToolParserSelection


@dataclass(frozen=True)
class ServerArgs:
    """The server's own options (engine options live in ``EngineConfig``).

    Attributes:
        served_model_names: Names clients use in ``model``; the first is reported. Default:
            the model's display name.
        api_key: When set, every route but ``/health``, ``/ping`` and ``public_paths``
            needs ``Authorization: Bearer <api_key>``.
        enable_endpoint_plugins: Load allowed ``engine.endpoints`` plugins.
        enable_dev_endpoints: Serve ``POST /collective_rpc`` (``--enable-dev-endpoints``).
        max_request_bytes: Largest request body accepted; a larger one is a 413
            (``--max-request-bytes``; default 32 MiB).
        public_paths: Routes served without the API key besides the probes
            (``--public-path``).
        enable_log_requests: Log each generation request's prompt and sampling
            parameters at INFO (``--enable-log-requests``; :mod:`engine.server.request_log`).
        max_log_len: Characters (and token ids) of a prompt shown in that line; None: all.
        enable_auto_tool_choice: Serve ``tool_choice: "auto"`` (``--enable-auto-tool-choice``;
            needs ``tool_call_parser``).
        tool_call_parser: The ``engine.tool_parsers`` entry (or ``module:Class``) that finds
            tool calls in the model's text (``--tool-call-parser``).
    """

    served_model_names: tuple[str, ...] = ()
    api_key: str | None = None
    enable_endpoint_plugins: bool = True
    enable_dev_endpoints: bool = False
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    public_paths: tuple[str, ...] = ()
    enable_log_requests: bool = False
    max_log_len: int | None = None
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None


@dataclass
class ServerState:
    """Kept on ``app.state.server``."""

    engine: AsyncLLM
    args: ServerArgs
    model_names: tuple[str, ...]
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: Any = None
    #: The ``--io-processor`` served on ``POST /pooling`` (None: the route answers 404).
    io_processor: IOProcessorHandle | None = None
    #: The ``--tool-call-parser`` behind ``tool_choice: "auto"`` (None: auto is refused).
    tool_parser: ToolParserSelection | None = None

    @property
    def model_name(self) -> str:
        """The name reported in responses."""
        return self.model_names[0]

    def check_model(self, model: str | None) -> str:
        """The served name for ``model`` (None: the default).

        Raises:
            APIError: 404 for a model this server does not serve.
        """
        if model is None or model in self.model_names:
            return model or self.model_name
        raise APIError(404, f"The model `{model}` does not exist. This server serves: "
                       f"{', '.join(self.model_names)}", param="model", code="model_not_found")


def server_state(request: Request) -> ServerState:
    """The shared state of the app serving ``request``."""
    state: ServerState = request.app.state.server
    return state


def random_id(prefix: str) -> str:
    """A fresh response id such as ``cmpl-3f2a...``."""
    return f"{prefix}-{uuid.uuid4().hex}"
