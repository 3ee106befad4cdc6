"""Audio in a chat request: OpenAI's ``{"type": "input_audio", "input_audio": {"data":
<base64>, "format": "wav"}}`` content parts, read for a Qwen3-Omni pipeline that hears
(:mod:`omni_async.speech.omni_hearing`).

A part's data is a WAV file of 16-bit PCM (read with the standard library's ``wave``;
several channels are averaged to mono) at any rate from 1 kHz to 384 kHz: the pipeline
resamples it to the rate the model hears (16 kHz for Qwen3-Omni;
:mod:`omni_async.models.resample`). Anything else (data that is not base64 or not a WAV
file, another format, another sample width, a rate outside those, a model that cannot
hear) is a 400 naming the part, on that request only. The template sees each part as
``{"type": "audio"}`` (:func:`~omni_async.server.chat_messages.template_messages` with
``hears``), which Qwen3-Omni's template writes as its audio placeholder.
"""

from __future__ import annotations

import base64
import binascii
import io
import struct
import wave
from typing import TYPE_CHECKING, Any

import numpy as np

from ..models.resample import MAX_RATE, MIN_RATE
from .errors import invalid

if TYPE_CHECKING:
    from ..speech.omni_hearing import AudioPart, Hearing
    from .chat_messages import ChatMessage

__all__ = ["audio_parts", "wav_samples"]


def audio_parts(messages: "list[ChatMessage]", hearing: "Hearing | None") -> "list[AudioPart]":
    """The request's ``input_audio`` parts in order, decoded; an InvalidRequestError
    naming the first bad one."""
    from ..speech.omni_hearing import AudioPart

    out = []
    for i, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            if part.get("type") != "input_audio":
                continue
            where = f"messages[{i}].content[{j}].input_audio"
            if hearing is None:
                raise invalid("this model cannot hear: input_audio needs a Qwen3-Omni model with an audio encoder", where)
            samples, rate = _decoded(part.get("input_audio"), where)
            if not MIN_RATE <= rate <= MAX_RATE:
                raise invalid(f"the audio is sampled at {rate} Hz; rates from {MIN_RATE} to {MAX_RATE} Hz are taken", where)
            out.append(AudioPart(samples, rate))
    return out


def _decoded(audio: Any, where: str) -> tuple[np.ndarray, int]:
    if not isinstance(audio, dict) or not isinstance(audio.get("data"), str):
        raise invalid("an input_audio part is {\"data\": <base64>, \"format\": \"wav\"}", where)
    if audio.get("format") != "wav":
        raise invalid(f"audio format {audio.get('format')!r} is not supported: send \"wav\" (16-bit PCM)", f"{where}.format")
    try:
        data = base64.b64decode(audio["data"], validate=True)
    except (binascii.Error, ValueError):
        raise invalid("the audio data is not base64", f"{where}.data") from None
    return wav_samples(data, f"{where}.data")


def wav_samples(data: bytes, where: str = "audio") -> tuple[np.ndarray, int]:
    """A WAV file's 16-bit PCM as float32 mono samples in [-1, 1), and its rate."""
    try:
        with wave.open(io.BytesIO(data)) as wav:
            width, channels, rate = wav.getsampwidth(), wav.getnchannels(), wav.getframerate()
            frames = wav.readframes(wav.getnframes())
    except (wave.Error, EOFError, RuntimeError, ValueError, struct.error) as exc:  # the reader's ways of failing on bad bytes
        raise invalid(f"the audio data is not a WAV file of PCM samples ({type(exc).__name__}: {exc})", where) from None
    if width != 2:
        raise invalid(f"the WAV file holds {8 * width}-bit samples; 16-bit PCM is supported", where)
    samples = np.frombuffer(frames[:len(frames) - len(frames) % (2 * channels)], dtype="<i2")
    if samples.size == 0:
        raise invalid("the WAV file holds no samples", where)
    mono = samples.reshape(-1, channels).astype(np.float32).mean(axis=1) / 32768.0
    return mono.astype(np.float32), rate
