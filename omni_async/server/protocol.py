"""OpenAI request bodies, and their translation into an engine request.

Fields the engine cannot honour (``echo``, ``suffix``) are refused with
InvalidRequestError rather than ignored, and unknown
fields are refused too, so a client never gets an answer to a question it did not ask.
Besides the OpenAI fields, the common extensions ``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``skip_special_tokens`` and ``include_stop_str_in_output`` are accepted.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from .. import errors
from ..config import SamplingParams
from .errors import invalid
from .chat_messages import ChatMessage
from .structured import ResponseFormat
from .tools import ToolChoice, ToolDefinition

DEFAULT_COMPLETION_MAX_TOKENS = 16  # the OpenAI default for /v1/completions
DEFAULT_TEMPERATURE = 1.0  # the OpenAI default


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid")

    model: str
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[str, list[str], None] = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None

    def openai_penalties(self) -> dict[str, Any]:
        """``presence_penalty``, ``frequency_penalty`` and ``logit_bias`` (token ids as
        JSON keys) for SamplingParams; zeros and empties are left at their defaults."""
        out: dict[str, Any] = {name: v for name in ("presence_penalty", "frequency_penalty") if (v := getattr(self, name))}
        if self.logit_bias:  # keys checked (and converted) by SamplingParams, in one place
            out["logit_bias"] = dict(self.logit_bias)
        return out

    def check_supported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options is only allowed when stream is true", "stream_options")

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling(self, max_tokens: int, *, top_logprobs: int | None, constraint: dict[str, Any] | None = None) -> SamplingParams:
        """The engine's SamplingParams; its own validation names a bad value.
        ``constraint``: the grammar fields (``json_schema``/``ebnf``) for the request."""
        self.check_supported()
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        kw: dict[str, Any] = {
            "max_new_tokens": max_tokens,
            "temperature": DEFAULT_TEMPERATURE if self.temperature is None else self.temperature,
            "n": self.n,
            "seed": self.seed,
            "stop": stop,
        }
        optional = {
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "min_new_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "stop_token_ids": self.stop_token_ids,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
        }
        kw.update({k: v for k, v in optional.items() if v is not None})
        kw.update(self.openai_penalties())
        kw.update(constraint or {})
        if top_logprobs is not None:
            kw.update(return_logprob=True, top_logprobs=top_logprobs)
        try:
            return SamplingParams(**kw)
        except TypeError as exc:  # a value of the wrong type that pydantic let through
            raise errors.InvalidRequestError(str(exc)) from None


class CompletionRequest(_Common):
    """``POST /v1/completions``: one or several prompts, as text or token ids."""

    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: int | None = DEFAULT_COMPLETION_MAX_TOKENS
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def engine_inputs(self) -> list[dict[str, Any]]:
        """``prompt=`` or ``input_ids=`` for Engine.submit, one per prompt: a string or a
        list of ids is one prompt, a list of strings or of id lists is several."""
        if self.echo:
            raise errors.InvalidRequestError("echo is not supported")
        if self.suffix:
            raise errors.InvalidRequestError("suffix is not supported")
        if self.best_of not in (None, self.n):
            raise errors.InvalidRequestError("best_of other than n is not supported")
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts: list[Any] = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise errors.InvalidRequestError("prompt is empty")
        return [{"prompt": p} if isinstance(p, str) else {"input_ids": list(p)} for p in prompts]


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``: rendered with the checkpoint's chat template."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def chat_top_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise errors.InvalidRequestError("top_logprobs needs logprobs=true")
            return None
        return self.top_logprobs or 0

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

