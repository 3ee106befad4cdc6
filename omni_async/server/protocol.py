"""OpenAI request bodies, and their translation into an engine request.

Fields the engine cannot honour (``suffix``) are refused with InvalidRequestError
rather than ignored. A field this server does not know at all (one a
newer client sends: ``store``, ``metadata``, ``service_tier``...) is ignored with one
warning per field name, as vLLM does, and ``null`` stands for "not given" in every
optional field. Besides the OpenAI fields, the common extensions ``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``skip_special_tokens`` and ``include_stop_str_in_output`` are accepted, and the
structured-output fields of vLLM and SGLang (:mod:`omni_async.server.structured`).
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .. import errors
from ..config import MAX_PROMPT_LOGPROBS, SamplingParams
from ..logs import log
from .errors import invalid
from .chat_messages import ChatMessage
from .structured import ResponseFormat, StructuredOutputs, request_constraint
from .tools import ToolChoice, ToolDefinition

DEFAULT_COMPLETION_MAX_TOKENS = 16  # the OpenAI default for /v1/completions
DEFAULT_TEMPERATURE = 1.0  # the OpenAI default


_WARNED: set[str] = set()  # unknown field names already logged (once per name per process)


def warn_unknown(names: Any) -> None:
    """Log each unknown field name the first time a request sends it."""
    for name in names:
        if name not in _WARNED:
            _WARNED.add(name)
            log.warning("server_unknown_field_ignored", field=name)


class Lenient(BaseModel):
    """A request body as vLLM reads one: ``null`` means the field's default, and a field
    this server does not know is dropped (logged once per name)."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _nulls_and_unknowns(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        known = _KNOWN.get(cls)
        if known is None:  # once per class: every request body passes here
            known = _KNOWN[cls] = frozenset({f.alias or name for name, f in cls.model_fields.items()} | set(cls.model_fields))
        if not known.issuperset(data):
            warn_unknown(sorted(k for k in data if k not in known))
        return {k: v for k, v in data.items() if v is not None and k in known}


_KNOWN: dict[type, frozenset[str]] = {}  # each request model's field names and aliases


class StreamOptions(Lenient):
    include_usage: bool = False


class _Common(Lenient):
    """Fields shared by completions and chat completions."""

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
    # structured output, as OpenAI, SGLang and vLLM (new and old names) take it
    response_format: ResponseFormat | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_schema: Union[str, dict[str, Any], None] = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: Union[str, dict[str, Any], None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    # vLLM's: the prompt's tokens scored, in the response's ``prompt_logprobs`` (server.scoring)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_PROMPT_LOGPROBS)

    def constraint(self) -> dict[str, Any]:
        """The grammar fields for SamplingParams, from whichever field the client used."""
        return request_constraint(self)

    def openai_penalties(self) -> dict[str, Any]:
        """``presence_penalty``, ``frequency_penalty`` and ``logit_bias`` (token ids as
        JSON keys) for SamplingParams; zeros and empties are left at their defaults."""
        out: dict[str, Any] = {name: v for name in ("presence_penalty", "frequency_penalty") if (v := getattr(self, name))}
        if self.logit_bias:  # keys checked (and converted) by SamplingParams, in one place
            out["logit_bias"] = dict(self.logit_bias)
        return out

    def check_supported(self) -> None:
        if self.prompt_logprobs is not None and self.stream:
            raise invalid("prompt_logprobs is not available with stream=true (as in vLLM); use echo with logprobs on /v1/completions", "prompt_logprobs")
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options is only allowed when stream is true", "stream_options")

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling(
        self, max_tokens: int, *, top_logprobs: int | None, constraint: dict[str, Any] | None = None,
        defaults: dict[str, Any] | None = None, prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """The engine's SamplingParams; its own validation names a bad value.
        ``constraint``: the grammar fields (``json_schema``/``ebnf``) for the request;
        ``defaults``: request fields' values where the request leaves them unset (the
        checkpoint's generation_config.json); ``prompt_logprobs``: the engine's
        (:func:`omni_async.server.scoring.engine_prompt_logprobs`)."""
        self.check_supported()
        defaults = defaults or {}
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        temperature = self.temperature if self.temperature is not None else defaults.get("temperature", DEFAULT_TEMPERATURE)
        kw: dict[str, Any] = {
            "max_new_tokens": max_tokens,
            "temperature": temperature,
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
        for name, ours in (("top_p", "top_p"), ("top_k", "top_k"), ("min_p", "min_p"), ("repetition_penalty", "repetition_penalty")):
            if optional[ours] is None and name in defaults:
                optional[ours] = defaults[name]
        kw.update({k: v for k, v in optional.items() if v is not None})
        kw.update(self.openai_penalties())
        kw.update(constraint or {})
        if top_logprobs is not None:
            kw.update(return_logprob=True, top_logprobs=top_logprobs)
        if prompt_logprobs is not None:
            kw["prompt_logprobs"] = prompt_logprobs
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


AUDIO_FORMATS = ("wav", "pcm16")  # chat audio out: a WAV file, or raw 16-bit mono PCM at the model's rate
MODALITIES = ("text", "audio")


class ChatAudio(Lenient):
    """``audio`` of a chat request asking for speech: the voice and the encoding."""

    voice: str
    format: str = "wav"


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``: rendered with the checkpoint's chat template."""

    messages: list[ChatMessage]
    modalities: list[str] | None = None
    audio: ChatAudio | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] | None = None
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

    def wants_audio(self) -> bool:
        """Whether the reply is to be spoken (``modalities`` holds "audio"), its ``audio``
        checked: a voice, and a format of :data:`AUDIO_FORMATS`."""
        modalities = self.modalities or ["text"]
        unknown = [m for m in modalities if m not in MODALITIES]
        if unknown:
            raise invalid(f"unknown modality {unknown[0]!r}: modalities may hold {' and '.join(MODALITIES)}", "modalities")
        if "audio" not in modalities:
            return False
        if "text" not in modalities:
            raise invalid("an audio reply comes with its text: modalities must be [\"text\", \"audio\"]", "modalities")
        if self.audio is None:
            raise invalid("modalities asks for audio: give audio: {\"voice\": ..., \"format\": ...}", "audio")
        if self.audio.format not in AUDIO_FORMATS:
            raise invalid(f"audio.format {self.audio.format!r} is not supported: use {' or '.join(AUDIO_FORMATS)}", "audio.format")
        return True

