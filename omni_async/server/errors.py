"""Typed engine errors -> HTTP status codes and OpenAI-style error bodies.

The mapping is what OpenAI clients act on: 400 is the caller's mistake (not retried),
429 and 503 are retried with back-off by the official client.
"""

from __future__ import annotations

from typing import Any

from .. import errors

_QUEUE_FULL = ("queue full", "backlog is full")


def status_of(exc: BaseException) -> int:
    """The HTTP status for an error raised before a response started."""
    if isinstance(exc, errors.SchedulerClosedError):
        return 503
    if isinstance(exc, errors.RequestRejectedError):
        return 429 if any(s in str(exc) for s in _QUEUE_FULL) else 400
    if isinstance(exc, (errors.InvalidRequestError, errors.ConfigError)):
        return 400
    if isinstance(exc, errors.RequestAbortedError):
        return 503  # aborted by a pause or an admin action: try again later
    return 500


_TYPES = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error", 503: "service_unavailable", 500: "server_error"}


def error_body(message: str, status: int, *, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}`` as OpenAI sends it."""
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param, "code": code}}


def body_of(exc: BaseException) -> tuple[int, dict[str, Any]]:
    status = status_of(exc)
    return status, error_body(f"{type(exc).__name__}: {exc}", status, code=type(exc).__name__)
