"""``POST /tokenize`` and ``POST /detokenize`` (the bodies vLLM's server takes).

``/tokenize`` takes ``{"model", "prompt"}`` (encoded as ``/v1/completions`` encodes it:
with the tokenizer's special tokens unless ``add_special_tokens`` is false) or
``{"model", "messages"}`` (rendered as ``/v1/chat/completions`` renders them, ``tools``
included) and answers ``{"tokens", "count", "max_model_len"}``: the ids a request with
that input is charged for. ``/detokenize`` takes ``{"model", "tokens"}`` and answers
``{"prompt"}``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Union

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from .. import errors
from .chat_messages import ChatMessage
from .served import ServedModel
from .tools import ToolDefinition, plan_tools

if TYPE_CHECKING:
    from ..text.tokenizer import Tokenizer


class TokenizeCompletion(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    prompt: str
    add_special_tokens: bool = True


class TokenizeChat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    tools: list[ToolDefinition] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class Detokenize(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    tokens: list[int]


def _tokenizer(server: ServedModel) -> "Tokenizer":
    if server.engine.tokenizer is None:
        raise errors.InvalidRequestError("this model has no tokenizer (no tokenizer.json in its folder)")
    return server.engine.tokenizer


def tokenize_ids(server: ServedModel, body: Union[TokenizeCompletion, TokenizeChat]) -> list[int]:
    tokenizer = _tokenizer(server)
    if isinstance(body, TokenizeCompletion):
        return tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    tools = plan_tools(body.tools, None, None, frozenset({"tools"})).tools
    return server.render(body.messages, tools, add_generation_prompt=body.add_generation_prompt, template_kwargs=body.chat_template_kwargs)


def detokenize_text(server: ServedModel, body: Detokenize) -> str:
    tokenizer = _tokenizer(server)
    vocab = server.engine.scheduler.limits.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise errors.InvalidRequestError(f"tokens: {bad[0]} is outside the vocabulary (size {vocab})")
    return tokenizer.decode(body.tokens, skip_special_tokens=False)


def add_tokenize_routes(app: FastAPI, server: ServedModel) -> None:
    """``POST /tokenize`` and ``POST /detokenize`` on ``app``, for ``server``'s model."""

    async def tokenize(body: Union[TokenizeCompletion, TokenizeChat]) -> Response:
        wrong = server.check_model(body.model)
        if wrong is not None:
            return wrong
        ids = tokenize_ids(server, body)
        out: dict[str, Any] = {"tokens": ids, "count": len(ids), "max_model_len": server.engine.scheduler.limits.context_length}
        return JSONResponse(out)

    async def detokenize(body: Detokenize) -> Response:
        wrong = server.check_model(body.model)
        if wrong is not None:
            return wrong
        return JSONResponse({"prompt": detokenize_text(server, body)})

    app.post("/tokenize", response_model=None)(tokenize)
    app.post("/detokenize", response_model=None)(detokenize)
