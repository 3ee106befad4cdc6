"""OpenAI request bodies, and their translation into an engine request.

Fields the engine cannot honour (``echo``, ``suffix``, penalties other than zero,
``logit_bias``) are refused with InvalidRequestError rather than ignored, and unknown
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

    def check_supported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise errors.InvalidRequestError(f"{name} is not supported (use repetition_penalty)")
        if self.logit_bias:
            raise errors.InvalidRequestError("logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options is only allowed when stream is true", "stream_options")

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling(self, max_tokens: int, *, top_logprobs: int | None) -> SamplingParams:
        """The engine's SamplingParams; its own validation names a bad value."""
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
        if top_logprobs is not None:
            kw.update(return_logprob=True, top_logprobs=top_logprobs)
        try:
            return SamplingParams(**kw)
        except TypeError as exc:  # a value of the wrong type that pydantic let through
            raise errors.InvalidRequestError(str(exc)) from None


class CompletionRequest(_Common):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: int | None = DEFAULT_COMPLETION_MAX_TOKENS
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def engine_input(self) -> dict[str, Any]:
        """``prompt=`` or ``input_ids=`` for Engine.submit."""
        if self.echo:
            raise errors.InvalidRequestError("echo is not supported")
        if self.suffix:
            raise errors.InvalidRequestError("suffix is not supported")
        if self.best_of not in (None, self.n):
            raise errors.InvalidRequestError("best_of other than n is not supported")
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise errors.InvalidRequestError("one prompt per request: send a list of several prompts as several requests")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return {"prompt": prompt}
        return {"input_ids": list(prompt)}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[dict[str, Any]], None] = None


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``: rendered with the checkpoint's chat template."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    def engine_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template expects them: text content only."""
        if not self.messages:
            raise errors.InvalidRequestError("messages is empty")
        return [{"role": m.role, "content": _text_content(m.content)} for m in self.messages]

    def chat_top_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise errors.InvalidRequestError("top_logprobs needs logprobs=true")
            return None
        return self.top_logprobs or 0

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def _text_content(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise errors.InvalidRequestError(f"unsupported message content part {part.get('type')!r}: only text is supported")
        parts.append(part["text"])
    return "".join(parts)
