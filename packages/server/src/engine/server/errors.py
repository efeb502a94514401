"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``.

=====  ==========================  =================================================
 400   ``invalid_request_error``   malformed JSON, wrong types, unknown or unsupported
                                   fields, out-of-range values, prompt or max_tokens
                                   beyond the context, plugin parameters
                                   (``validate_params``)
 401   ``authentication_error``    ``--api-key`` set and the request lacks it (/v1/*)
 404   ``invalid_request_error``   unknown model (code ``model_not_found``) or route
                                   (``POST /pooling`` without ``--io-processor``:
                                   code ``io_processor_not_enabled``)
 503   ``server_error``            the engine is dead or shutting down
 500   ``server_error``            a plugin failed while serving this request (code
                                   ``plugin_error``; the message names the plugin,
                                   its group and distribution), or a bug (code
                                   ``internal_error``, logged with its traceback)
=====  ==========================  =================================================

An error never costs the client its connection: an exception no handler takes is answered
with the JSON 500 (code ``internal_error``), and :class:`KeepConnectionOnError` keeps the
keep-alive connection usable for the next request.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.core.messages import EngineDeadError
from engine.sdk.errors import PluginError, ValidationError

logger = logging.getLogger("engine.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error",
          404: "invalid_request_error", 405: "invalid_request_error",
          500: "server_error", 503: "server_error"}


class APIError(Exception):
    """An error answered with ``status`` and the OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def error_body(status: int, message: str, *, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The OpenAI error object for ``status``."""
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


class _ErrorJSONResponse(JSONResponse):
    """A JSON response that renders any message, even one holding a lone surrogate."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:  # escaped as \udXXX: still valid JSON, and ASCII
            return json.dumps(content, separators=(",", ":")).encode("ascii")


def error_response(status: int, message: str, *, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    """A JSON response with the OpenAI error body."""
    return _ErrorJSONResponse(error_body(status, message, param=param, code=code),
                              status_code=status)


def to_api_error(exc: BaseException) -> APIError:
    """Map an exception raised while serving a request to its HTTP error."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValidationError):
        return APIError(400, str(exc), param=exc.param)
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"the engine is not available: {exc}", code="engine_unavailable")
    if isinstance(exc, PluginError):
        logger.error("a plugin failed while serving a request: %s", exc, exc_info=exc)
        return APIError(500, str(exc), code="plugin_error")
    logger.error("internal error while serving a request", exc_info=exc)
    return APIError(500, f"internal server error: {type(exc).__name__}: {exc}",
                    code="internal_error")


def _param_of(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    # Drop pydantic's union-member tags ("str", "list[int]", "TokenizeChatRequest").
    parts = [p for p in parts
             if not ("[" in p or p in {"str", "int", "float", "bool"} or p[:1].isupper())]
    return ".".join(parts) or None


def describe_validation_errors(errors: list[Any]) -> tuple[str, str | None]:
    """One message (and the first field) for pydantic's errors."""
    messages = []
    first_param: str | None = None
    for error in errors:
        param = _param_of(tuple(error.get("loc", ())))
        kind = error.get("type", "")
        if kind == "json_invalid":
            ctx = error.get("ctx") or {}
            messages.append(f"malformed JSON body: {ctx.get('error', error.get('msg'))} "
                            f"(at character {param})")
            param = None
        elif kind == "extra_forbidden":
            messages.append(f"unknown field {param!r}: this API does not define it")
        elif kind == "missing":
            messages.append(f"{param} is required" if param else
                            "the request body is required: send a JSON object")
        elif param is None and isinstance(error.get("input"), (bytes, bytearray)):
            messages.append("the request body must be a JSON object sent with "
                            "Content-Type: application/json")
        else:
            where = f"{param}: " if param else "body: "
            given = json.dumps(error.get("input"), default=str)[:80]
            messages.append(f"{where}{error.get('msg')} (got {given})")
        first_param = first_param or param
    return "; ".join(dict.fromkeys(messages)), first_param


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error with the OpenAI body and the status in the module docstring."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_errors(list(exc.errors()))
        return error_response(400, message, param=param)

    @app.exception_handler(ValidationError)
    async def _validation(request: Request, exc: ValidationError) -> JSONResponse:
        return error_response(400, str(exc), param=exc.param)

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, param=exc.param, code=exc.code)

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        error = to_api_error(exc)
        return error_response(error.status, error.message, code=error.code)

    @app.exception_handler(PluginError)
    async def _plugin(request: Request, exc: PluginError) -> JSONResponse:
        error = to_api_error(exc)
        return error_response(error.status, error.message, code=error.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, _http_detail(exc))

    # Starlette's ServerErrorMiddleware calls this one for any exception nothing else took
    # (from a route or a middleware), sends its answer, then re-raises the exception:
    # KeepConnectionOnError, wrapped around the whole stack, stops it there.
    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        error = to_api_error(exc)  # logs it, with its traceback
        return error_response(error.status, error.message, code=error.code)

    # Outside ServerErrorMiddleware, which add_middleware cannot reach: Starlette builds the
    # stack on the first request by calling build_middleware_stack, so this wrapper becomes
    # the outermost layer whatever middleware is added later.
    build_stack = app.build_middleware_stack

    def build_wrapped_stack() -> ASGIApp:
        return KeepConnectionOnError(build_stack())

    app.build_middleware_stack = build_wrapped_stack  # type: ignore[method-assign]


def _http_detail(exc: StarletteHTTPException) -> str:
    """The message of an HTTP error; for a body that failed to parse, why it failed."""
    cause = exc.__cause__
    if exc.status_code != 400 or cause is None or not str(exc.detail).startswith(
            "There was an error parsing the body"):
        return str(exc.detail)
    why = ("arrays or objects are nested too deeply" if isinstance(cause, RecursionError)
           else f"{type(cause).__name__}: {cause}")
    return f"the request body could not be parsed ({why}); send a JSON object encoded as UTF-8"


class KeepConnectionOnError:
    """Keep the connection open after an error 500 that was answered already.

    Starlette's ``ServerErrorMiddleware`` answers an exception that no handler took (with
    the JSON 500 of the ``Exception`` handler, which logs it) and then re-raises it for the
    server to log; uvicorn then closes the keep-alive connection, so the client's next
    request on it fails with a reset. Wrapped around the whole app, this layer ends the
    exception once its response is complete. An exception in a response that had started
    but not finished is re-raised: the server must close the connection on the
    incomplete response.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        finished = False

        async def watching_send(message: Message) -> None:
            nonlocal finished
            if message["type"] == "http.response.body" and not message.get("more_body"):
                finished = True
            await send(message)

        try:
            await self.app(scope, receive, watching_send)
        except Exception:
            if not finished:
                raise
            # Answered and logged by the Exception handler: nothing is left to do.
