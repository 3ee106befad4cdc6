"""Server options a user moving from vLLM or SGLang expects: ``--api-key`` (a Bearer
token on every route but the open ones), ``--chat-template`` (a file or an inline Jinja
string in place of the checkpoint's), and the sampling defaults a checkpoint ships in
``generation_config.json`` (used where a request leaves a field unset, as vLLM's
``--generation-config auto`` does).
"""

from __future__ import annotations

import hmac
import json
import os
from pathlib import Path
from typing import Any

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from .. import errors
from .errors import error_body

# Routes answered without a key: liveness for load balancers, scrapes, the version.
OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})

# generation_config.json field -> the request field it is the default of
GENERATION_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}


class ApiKeyGuard:
    """ASGI middleware: 401 unless ``Authorization: Bearer <api_key>`` (open paths and
    CORS preflights excepted). A plain ASGI wrapper, not an ``@app.middleware("http")``
    function: those pass every streamed chunk through a memory stream and a task of their
    own, a cost per token on the loop the engine shares."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k.lower() == b"authorization"), b"")
        if not hmac.compare_digest(given, self.expected):
            body = error_body("invalid or missing API key (send Authorization: Bearer <key>)", 401, code="invalid_api_key")
            await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        await self.app(scope, receive, send)


def chat_template_text(value: str) -> str:
    """``--chat-template``: the contents of a file, or the string itself when it is no file
    (an inline template must contain Jinja markup, so a mistyped path is not taken for one)."""
    path = Path(os.path.expanduser(value))
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise errors.ConfigError(f"--chat-template: {value!r} is neither a file nor a Jinja template")


def generation_defaults(model_path: str | os.PathLike[str] | None) -> dict[str, Any]:
    """The sampling defaults in the checkpoint folder's ``generation_config.json`` (request
    field names); empty when there is none. Like vLLM, ``do_sample`` is not read: the
    fields themselves are the defaults."""
    if not model_path:
        return {}
    path = Path(model_path) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(raw, dict):
        return {}
    out = {ours: raw[theirs] for theirs, ours in GENERATION_FIELDS.items() if isinstance(raw.get(theirs), (int, float)) and not isinstance(raw.get(theirs), bool)}
    return out
