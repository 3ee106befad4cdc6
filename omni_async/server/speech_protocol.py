"""The body of ``POST /v1/audio/speech``: OpenAI's fields, and this server's own.

OpenAI's: ``model``, ``input``, ``voice`` (a name, or ``{"id": name}``),
``response_format``, ``speed``, ``instructions``, ``stream_format``. What the served
models cannot honour is refused with a 400 that says what is supported, never ignored:
formats other than ``wav`` and ``pcm`` (no compressed encoder here), a ``speed`` other
than 1, non-empty ``instructions`` (the CustomVoice models take none). Ours:
``language``, and the :class:`~omni_async.speech.SpeechParams` fields under their names.
An unknown field is refused too: a misspelt ``max_frames`` ignored would speak for
minutes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from ..speech import SpeechParams
from .errors import ClientNames, invalid

__all__ = ["SpeechRequest", "SpeechPlan", "FORMATS", "STREAM_FORMATS", "SPEECH_NAMES"]

FORMATS = {"wav": "audio/wav", "pcm": "audio/pcm"}
STREAM_FORMATS = ("audio", "sse")
_PARAM_FIELDS = tuple(SpeechParams.__dataclass_fields__)


class SpeechRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input: str
    model: str | None = None
    voice: str | dict[str, Any] | None = None
    response_format: str = "wav"
    speed: float = 1.0
    instructions: str | None = None
    stream_format: str | None = None
    language: str | None = None
    max_frames: int | None = None
    min_frames: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    predictor_temperature: float | None = None
    predictor_top_k: int | None = None
    predictor_top_p: float | None = None
    seed: int | None = None
    ignore_eos: bool | None = None

    def plan(self) -> "SpeechPlan":
        """What to run and how to send it; InvalidRequestError naming the field that
        cannot be honoured."""
        if self.response_format not in FORMATS:
            raise invalid(f"response_format {self.response_format!r} is not supported: this server writes "
                          f"{' or '.join(FORMATS)} (16-bit mono PCM)", "response_format")
        if self.stream_format is not None and self.stream_format not in STREAM_FORMATS:
            raise invalid(f"stream_format {self.stream_format!r} is not supported: use audio or sse", "stream_format")
        if self.speed != 1.0:
            raise invalid(f"speed {self.speed} is not supported: the served model speaks at 1.0 only", "speed")
        if self.instructions:
            raise invalid("instructions are not supported: the served model takes a voice, not a description of one", "instructions")
        params = {name: getattr(self, name) for name in _PARAM_FIELDS if getattr(self, name) is not None}
        return SpeechPlan(self.voice_name(), self.language, SpeechParams.of(params), self.response_format, self.stream_format)

    def voice_name(self) -> str | None:
        if isinstance(self.voice, dict):
            name = self.voice.get("id")
            if not isinstance(name, str) or set(self.voice) != {"id"}:
                raise invalid('voice must be a name or {"id": name}', "voice")
            return name
        return self.voice


@dataclass(frozen=True)
class SpeechPlan:
    voice: str | None
    language: str | None
    params: SpeechParams
    response_format: str
    stream_format: str | None


# The pipeline's errors say "text" where the request says ``input``.
SPEECH_NAMES = ClientNames({"text": "input"}, frozenset(SpeechRequest.model_fields) - {"model"})
