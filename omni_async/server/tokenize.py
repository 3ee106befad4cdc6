"""``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info`` (as vLLM serves them).

``/tokenize`` takes ``{"prompt"}`` (encoded as ``/v1/completions`` encodes it: with the
tokenizer's special tokens unless ``add_special_tokens`` is false) or ``{"messages"}``
(rendered as ``/v1/chat/completions`` renders them, ``tools`` included) and answers
``{"tokens", "count", "max_model_len"}`` (and ``token_strs`` with ``return_token_strs``):
the ids a request with that input is charged for. ``/detokenize`` takes ``{"tokens"}`` and
answers ``{"prompt"}``. ``model`` is optional in both, as in vLLM (a tokenizer-only
client such as lm-eval's remote tokenizer sends none); given, it must be the served one.
``/tokenizer_info`` answers the tokenizer's configuration (what ``tokenizer_config.json``
holds that this server knows: class, special tokens, chat template, lengths).
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
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    messages: list[ChatMessage]
    return_token_strs: bool = False
    add_generation_prompt: bool = True
    tools: list[ToolDefinition] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class Detokenize(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
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


def tokenizer_info(server: ServedModel) -> dict[str, Any]:
    """The tokenizer's configuration, in ``tokenizer_config.json``'s names."""
    tokenizer = _tokenizer(server)
    info: dict[str, Any] = {
        "tokenizer_class": type(tokenizer).__name__,
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "eos_token_ids": list(tokenizer.eos_token_ids),
        "vocab_size": tokenizer.vocab_size,
        "model_max_length": server.engine.scheduler.limits.context_length,
        "chat_template": tokenizer.chat_template,
    }
    info.update(getattr(tokenizer, "special_tokens", {}))  # unk_token, pad_token where the checkpoint names them
    return info


def add_tokenize_routes(app: FastAPI, server: ServedModel) -> None:
    """``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info`` on ``app``."""

    def wrong_model(model: str | None) -> Response | None:
        return None if model is None else server.check_model(model)

    async def tokenize(body: Union[TokenizeCompletion, TokenizeChat]) -> Response:
        wrong = wrong_model(body.model)
        if wrong is not None:
            return wrong
        ids = tokenize_ids(server, body)
        out: dict[str, Any] = {"tokens": ids, "count": len(ids), "max_model_len": server.engine.scheduler.limits.context_length}
        if body.return_token_strs:
            tokenizer = _tokenizer(server)
            out["token_strs"] = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
        return JSONResponse(out)

    async def detokenize(body: Detokenize) -> Response:
        wrong = wrong_model(body.model)
        if wrong is not None:
            return wrong
        return JSONResponse({"prompt": detokenize_text(server, body)})

    async def info() -> Response:
        return JSONResponse(tokenizer_info(server))

    app.post("/tokenize", response_model=None)(tokenize)
    app.post("/detokenize", response_model=None)(detokenize)
    app.get("/tokenizer_info", response_model=None)(info)
