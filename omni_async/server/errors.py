"""Typed engine errors -> HTTP status codes and OpenAI-style error bodies.

The mapping is what OpenAI clients act on: 400 is the caller's mistake (not retried),
429 and 5xx are retried with back-off by the official client. Every body is
``{"error": {"message", "type", "param", "code"}}``; ``message`` and ``param`` name the
field as the client sent it (``max_tokens``, not the engine's ``max_new_tokens``), and
``code`` is one of OpenAI's (``invalid_value``, ``unknown_parameter``,
``context_length_exceeded``, ``model_not_found``, ``rate_limit_exceeded`` ...), or null
where OpenAI sends none (server errors).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from .. import errors

_QUEUE_FULL = ("queue full", "backlog is full")
_OVER_CAPACITY = ("context length", "KV cache capacity")


def status_of(exc: BaseException) -> int:
    """The HTTP status for an error raised before a response started."""
    if isinstance(exc, (errors.SchedulerClosedError, errors.OverloadedError)):
        return 503
    if isinstance(exc, errors.RequestRejectedError):
        return 429 if any(s in str(exc) for s in _QUEUE_FULL) else 400
    if isinstance(exc, (errors.InvalidRequestError, errors.ConfigError)):
        return 400
    if isinstance(exc, errors.RequestAbortedError):
        return 503  # aborted by a pause or an admin action: try again later
    return 500


def code_of(exc: BaseException, status: int) -> str | None:
    """OpenAI's error code for ``exc``."""
    text = str(exc)
    if isinstance(exc, errors.OverloadedError):
        return exc.reason
    if status == 429:
        return "rate_limit_exceeded"
    if isinstance(exc, errors.RequestRejectedError) and any(s in text for s in _OVER_CAPACITY):
        return "context_length_exceeded"
    if status == 400:
        if "unknown" in text and ("field" in text or "parameter" in text):
            return "unknown_parameter"
        if "not supported" in text:
            return "unsupported_parameter"
        return "invalid_value"
    return None


def type_of(status: int) -> str:
    if status == 429:
        return "requests"
    return "server_error" if status >= 500 else "invalid_request_error"


def error_body(message: str, status: int, *, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}`` as OpenAI sends it."""
    return {"error": {"message": message, "type": type_of(status), "param": param, "code": code}}


def invalid(message: str, param: str) -> errors.InvalidRequestError:
    """An InvalidRequestError that names the request field it is about."""
    err = errors.InvalidRequestError(message)
    err.param = param  # type: ignore[attr-defined]
    return err


@dataclass(frozen=True)
class ClientNames:
    """How one request's fields are called by the client: the engine's names that
    differ (``max_new_tokens`` -> ``max_tokens``) and every field the client can send."""

    renames: Mapping[str, str] = field(default_factory=dict)
    fields: frozenset[str] = frozenset()

    def message(self, text: str) -> str:
        if not self.renames:
            return text
        pattern = re.compile(r"\b(" + "|".join(map(re.escape, self.renames)) + r")\b")
        return pattern.sub(lambda m: self.renames[m.group(1)], text)

    def param(self, text: str) -> str | None:
        """The first client field the (renamed) message names."""
        for word in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text):
            if word in self.fields:
                return word
        return None


def body_of(exc: BaseException, names: ClientNames | None = None) -> tuple[int, dict[str, Any]]:
    names = names or ClientNames()
    status = status_of(exc)
    message = names.message(str(exc))
    param = getattr(exc, "param", None) or (names.param(message) if status == 400 else None)
    return status, error_body(message, status, code=code_of(exc, status), param=param)


def single_error(exc: BaseException) -> BaseException:
    """The one error inside (nested) exception groups, as a task group raises it; the
    group itself when it holds several."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc
