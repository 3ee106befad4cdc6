"""The exception handlers that give every error of an app the OpenAI shape: a typed
engine error, a body that does not parse, an unknown route or method, a bug. The text and
speech apps both install them."""

from __future__ import annotations

from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import errors
from ..logs import log
from ..version import __version__
from .errors import body_of, error_body, single_error
from .request_errors import validation_error_body

__all__ = ["add_error_handlers", "add_service_routes"]


def add_error_handlers(app: FastAPI, answerable: Callable[[errors.OmniAsyncError], errors.OmniAsyncError] = lambda e: e) -> None:
    """``answerable``: the error as the client is told it (the text server words a few
    of its engine's errors for its clients)."""

    @app.exception_handler(errors.OmniAsyncError)
    async def typed_error(request: Request, exc: errors.OmniAsyncError) -> JSONResponse:
        status, body = body_of(answerable(exc), getattr(request.state, "client_names", None))
        return JSONResponse(body, status_code=status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(validation_error_body(exc.errors()), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            message = f"Invalid URL ({where})"
        elif exc.status_code == 405:
            message = f"Invalid method for URL ({where})"
        else:
            message = str(exc.detail)
        return JSONResponse(error_body(message, exc.status_code), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        """A typed error inside an exception group gets its own answer; the rest is a
        500 (logged)."""
        inner = single_error(exc)
        if isinstance(inner, errors.OmniAsyncError):
            return await typed_error(request, inner)
        log.error("server_request_failed", path=request.url.path, error=repr(exc))
        return JSONResponse(error_body(f"internal server error: {type(inner).__name__}", 500), status_code=500)


def add_service_routes(app: FastAPI, engine: Any, metrics: Any) -> None:
    """``/health`` (GET and HEAD: load balancers probe with HEAD; 503 once the engine is
    closed or not serving), ``/metrics`` (``metrics.render()``, Prometheus text) and
    ``/version``: the same on every app."""
    from .metrics import CONTENT_TYPE_LATEST

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if engine.event_loop is None or engine.scheduler.closed:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def scrape() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": __version__})
