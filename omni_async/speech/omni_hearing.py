"""Qwen3-Omni's thinker hears: a prompt's audio parts turned into the rows of its input
embeddings, as the reference's processor and ``generate`` make them.

A caller's chat message may hold audio content parts (``{"type": "audio", "audio":
<float mono waveform>, "sample_rate": <Hz>}``). They reach the chat template as
``{"type": "audio"}`` parts, which Qwen3-Omni's template writes as
``<|audio_start|><|audio_pad|><|audio_end|>``; the rendered prompt must hold one
``<|audio_pad|>`` (``thinker_config.audio_token_id``) per audio part, in order. Each is
then expanded to as many placeholders as the audio encoder writes rows for that audio
(the processor's expansion), and the thinker's input embeddings are its embedding table's
rows with the encoder's rows in the placeholders' places (the reference's
``masked_scatter``). The thinker takes that prompt as ``input_embeds``.

Positions stay plain: with audio alone (no image or video grid) the reference's
multimodal rotary index is the running position on all three axes, which is what the
native decoder computes. The talker reads the thinker's ``accept_hidden_layer`` rows at
the placeholders (:func:`~.omni_talker.talker_prompt`, as ``generate`` does), so the
audio reaches it through the rows the thinker returns for its prompt.

The audio must be at the feature extractor's rate (16 kHz for Qwen3-Omni): resampling is
the caller's, and another rate is an :class:`~omni_async.errors.InvalidRequestError`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from .. import errors
from ..models.audio_encoder import AudioEncoder, AudioEncoderConfig
from ..models.audio_features import PREPROCESSOR_FILE, LogMel, LogMelConfig

__all__ = ["AudioPart", "Hearing", "HeardPrompt", "split_audio_parts"]


@dataclass(frozen=True)
class AudioPart:
    """One audio of a prompt: mono float samples at ``sample_rate``."""

    waveform: Any
    sample_rate: int


@dataclass
class HeardPrompt:
    """The thinker's prompt: ``ids`` with each audio's placeholders expanded, and
    ``embeds`` ``[len(ids), H]`` (None for a prompt without audio: the ids go as they are)."""

    ids: list[int]
    embeds: torch.Tensor | None


def split_audio_parts(messages: Any) -> tuple[Any, list[AudioPart]]:
    """Messages for the chat template (each audio part left as ``{"type": "audio"}``) and
    the audio parts in order; messages without audio are returned as they are."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        return messages, []
    audios: list[AudioPart] = []
    out = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list) or not any(_is_audio(p) for p in content):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            if _is_audio(part):
                audios.append(_audio_part(part, f"messages[{i}].content[{j}]"))
                parts.append({"type": "audio", "audio": None})
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out, audios


def _is_audio(part: Any) -> bool:
    """An audio part; OpenAI's ``input_audio`` (base64 bytes, the HTTP API's) counts as
    one so that it is refused by name rather than left for a template that ignores it."""
    return isinstance(part, Mapping) and part.get("type") in ("audio", "input_audio")


def _audio_part(part: Mapping[str, Any], where: str) -> AudioPart:
    if part.get("type") == "input_audio":
        raise errors.InvalidRequestError(f"{where}: input_audio parts (base64 files) are for HTTP; here an audio part is "
                                         "{'type': 'audio', 'audio': <float samples>, 'sample_rate': <int Hz>}")
    rate = part.get("sample_rate")
    if part.get("audio") is None or not isinstance(rate, int) or isinstance(rate, bool):
        raise errors.InvalidRequestError(f"{where}: an audio part is {{'type': 'audio', 'audio': <float samples>, "
                                         "'sample_rate': <int Hz>}")
    return AudioPart(part["audio"], rate)


class Hearing:
    """The feature extractor and the audio encoder (the thinker's embedding table is the
    caller's: :meth:`prompt` takes it)."""

    def __init__(self, features: LogMel, encoder: AudioEncoder, audio_token_id: int) -> None:
        if encoder.config.num_mel_bins != features.config.feature_size:
            raise errors.ModelLoadError(f"the audio encoder reads {encoder.config.num_mel_bins} mel bins; "
                                        f"{PREPROCESSOR_FILE} makes {features.config.feature_size}")
        self.features, self.encoder, self.audio_token_id = features, encoder, audio_token_id

    def check_width(self, width: int) -> None:
        """The encoder's rows must be the thinker's width (a ModelLoadError otherwise)."""
        if self.encoder.config.output_dim != width:
            raise errors.ModelLoadError(f"the audio encoder writes rows of {self.encoder.config.output_dim}; "
                                        f"the thinker's are {width} wide")

    @classmethod
    def from_folder(cls, folder: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                    seed: int | None = None) -> "Hearing | None":
        """The folder's ears on ``device`` in ``dtype`` (float32 on the CPU): built before
        the thinker, whose KV takes what the device has left;
        None for a folder that cannot hear (no ``audio_config``, no ``audio_token_id``, or
        no ``preprocessor_config.json``: the features' parameters). ``seed``: a
        random-weight folder's encoder drawn from it, its extractor at the config's mel
        bins when the folder has no ``preprocessor_config.json``."""
        folder = Path(folder)
        thinker = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("thinker_config") or {}
        if not thinker.get("audio_config") or thinker.get("audio_token_id") is None:
            return None
        if seed is None and not (folder / PREPROCESSOR_FILE).is_file():
            return None
        device = torch.device(device)
        dtype = torch.float32 if device.type == "cpu" else dtype
        cfg = AudioEncoderConfig.from_folder(folder)
        if seed is None:
            encoder = AudioEncoder.from_folder(folder, device=device, dtype=dtype)
        else:
            encoder = AudioEncoder.random(cfg, device=device, dtype=dtype, seed=seed)
        drawn_default = seed is not None and not (folder / PREPROCESSOR_FILE).is_file()
        mel = LogMelConfig(feature_size=cfg.num_mel_bins) if drawn_default else LogMelConfig.from_folder(folder)
        return cls(LogMel(mel), encoder, int(thinker["audio_token_id"]))

    @property
    def sample_rate(self) -> int:
        return self.features.config.sampling_rate

    def rows(self, audios: Sequence[AudioPart]) -> list[int]:
        """Each audio's placeholder count (the encoder's rows), from its length at the
        extractor's rate alone (no resampling: cheap enough for the event loop)."""
        lengths = [self.features.heard_length(self.features.check(a.waveform, a.sample_rate, f"audio {i}").shape[0], a.sample_rate)
                   for i, a in enumerate(audios)]
        padded = max(lengths, default=0)
        return [self.encoder.output_length(self.features.frames(n, padded)) for n in lengths]

    def expand(self, ids: Sequence[int], counts: Sequence[int]) -> list[int]:
        """``ids`` with its k-th audio placeholder repeated ``counts[k]`` times; an
        InvalidRequestError when the prompt holds another number of placeholders."""
        found = sum(1 for t in ids if t == self.audio_token_id)
        if found != len(counts):
            raise errors.InvalidRequestError(f"the prompt holds {found} audio placeholder(s) for {len(counts)} audio part(s): "
                                             "the chat template must write one <|audio_pad|> per audio part")
        out: list[int] = []
        k = 0
        for t in ids:
            if t == self.audio_token_id:
                out.extend([t] * counts[k])
                k += 1
            else:
                out.append(t)
        return out

    @torch.inference_mode()
    def prompt(self, ids: Sequence[int], audios: Sequence[AudioPart], embed: nn.Embedding) -> HeardPrompt:
        """The thinker's prompt for ``ids`` (one placeholder per audio) and ``audios``, its
        text rows from the thinker's embedding table ``embed`` (blocking: features and the
        encoder; a worker's job)."""
        counts = self.rows(audios)
        expanded = self.expand(ids, counts)
        waves = [self.features.heard(a.waveform, a.sample_rate, f"audio {i}") for i, a in enumerate(audios)]
        rows = self.encoder.encode(self.features.features(waves, self.sample_rate))
        table = embed.weight
        embeds = embed(torch.tensor(expanded, dtype=torch.long, device=table.device))
        mask = torch.tensor(expanded, device=table.device) == self.audio_token_id
        embeds[mask] = torch.cat(rows).to(embeds.dtype)
        return HeardPrompt(expanded, embeds)
