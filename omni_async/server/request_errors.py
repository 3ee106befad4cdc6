"""Errors about a request body, named as the client wrote it: the engine's field names
translated back to the OpenAI fields they came from, and pydantic's validation errors
turned into OpenAI's error body."""

from __future__ import annotations

from typing import Any, Sequence

from .errors import ClientNames, error_body
from .protocol import ChatCompletionRequest, CompletionRequest

_COMMON = {"min_new_tokens": "min_tokens", "return_logprob": "logprobs"}


def completion_names() -> ClientNames:
    renames = {**_COMMON, "max_new_tokens": "max_tokens", "top_logprobs": "logprobs", "input_ids": "prompt"}
    return ClientNames(renames, frozenset(CompletionRequest.model_fields))


def chat_names(*, max_completion_tokens: bool) -> ClientNames:
    """``max_completion_tokens``: the client sent that field (it wins over ``max_tokens``)."""
    renames = {**_COMMON, "max_new_tokens": "max_completion_tokens" if max_completion_tokens else "max_tokens", "input_ids": "messages"}
    return ClientNames(renames, frozenset(ChatCompletionRequest.model_fields))


_CODES = {"extra_forbidden": "unknown_parameter", "missing": "missing_required_parameter", "json_invalid": "invalid_json"}


def validation_error_body(problems: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """pydantic's errors for a body: every problem in the message, the first one's field
    as ``param`` (``messages.0.role``), its kind as ``code``."""
    parts = []
    for e in problems:
        where = ".".join(str(p) for p in e["loc"][1:]) or "body"
        parts.append(f"{where}: {e['msg']}")
    first = problems[0] if problems else {"loc": (), "type": ""}
    loc = [str(p) for p in first["loc"][1:]]
    param = loc[0] if loc and not loc[0].isdigit() else None  # the top-level field
    code = _CODES.get(first["type"], "invalid_value")
    return error_body(f"invalid request: {'; '.join(parts)}", 400, code=code, param=param)
