"""A codec stream's state and the chunks it sends (the codec stage's streams,
:mod:`~omni_async.speech.codec_stage`): what is waiting, what the listener has had, and
its urgency."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np
import torch

from .playback import Playback

__all__ = ["AudioChunk", "CodecStream", "power_of_two"]


@dataclass
class AudioChunk:
    """A stretch of one stream's audio: ``audio`` float32 PCM in [-1, 1] at
    ``sample_rate``, decoded from ``codes`` (``[frames, codebooks]``, on the CPU), the stream's
    frames ``first_frame .. first_frame + frames - 1``. ``finished`` on the last chunk,
    with the request's ``finish_reason``."""

    request_id: str
    audio: np.ndarray
    sample_rate: int
    codes: torch.Tensor
    first_frame: int
    finished: bool = False
    finish_reason: str | None = None

    @property
    def seconds(self) -> float:
        return len(self.audio) / self.sample_rate


@dataclass(eq=False)
class CodecStream:
    request_id: str
    send: Any
    receive: Any
    slot: int | None = None  # its rows in the slot store, from its first decoded chunk
    pending: list[torch.Tensor] = field(default_factory=list)  # frame rows on the device
    pending_frames: int = 0
    frames_sent: int = 0
    ended: bool = False  # the talker is done with it (no more frames)
    finish_reason: str | None = None
    closed: bool = False
    in_call: bool = False  # a chunk of it is in a lane's call: no other call takes it, its slot stays
    padding: int = 0  # zero frames after the real ones in its chunk in flight (an ended stream's last)
    playback: Playback = field(default_factory=Playback)  # what its listener has been sent and played

    @property
    def first_audio_at(self) -> float | None:
        return self.playback.first_audio_at

    def cut(self, n: int) -> torch.Tensor:
        """Its next ``n`` frames as a call's chunk; it is in a call from now. An ended
        stream's last frames may be fewer: the chunk is padded with zero codes to ``n`` (a
        captured graph's length) and ``padding`` says by how many. The decoder is causal, so
        the padding changes none of the real frames' samples; the caller drops its own."""
        rows = torch.cat(self.pending) if len(self.pending) > 1 else self.pending[0]
        chunk, rest = rows[:n], rows[n:]
        self.padding = n - int(chunk.shape[0])
        if self.padding:
            if not self.ended or rest.shape[0]:
                raise ValueError("only an ended stream's last chunk is padded")
            chunk = torch.cat([chunk, chunk.new_zeros(self.padding, chunk.shape[1])])
        self.pending = [rest] if rest.shape[0] else []
        self.pending_frames -= n - self.padding
        self.in_call = True
        return chunk.to(torch.long)

    def send_chunk(self, codes: torch.Tensor, pcm: np.ndarray, sample_rate: int, leading_samples: int) -> bool:
        """A chunk to its listener (the stream's first without its decoder's leading
        samples, which are not audio); True when it was the last."""
        last = self.ended and self.pending_frames == 0
        if self.frames_sent == 0:
            pcm = pcm[leading_samples:]
        chunk = AudioChunk(self.request_id, np.asarray(pcm, dtype=np.float32), sample_rate, codes, self.frames_sent, last,
                           self.finish_reason if last else None)
        self.frames_sent += int(codes.shape[0])
        self.playback.on_audio(chunk.seconds)
        if last:
            self.playback.finished = True
        try:
            self.send.send_nowait(chunk)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass
        return last

    def urgency(self, frame_seconds: float) -> float:
        """Seconds before its listener runs dry counting the frames waiting here (smaller
        first); a stream before its first chunk comes before every playing one."""
        if self.playback.first_audio_at is None:
            return -1.0
        return self.playback.slack() + self.pending_frames * frame_seconds


def power_of_two(n: int) -> int:
    """The largest power of two at most ``n`` (``n >= 1``)."""
    return 1 << (max(1, n).bit_length() - 1)
