"""PCM as bytes: 16-bit little-endian mono samples and the WAV header around them.

One conversion for every way audio leaves the process (a whole file, a streamed body,
base64 in server-sent events, ``omni-async speak``), so the same utterance gives the
same bytes whichever way it is asked for.
"""

from __future__ import annotations

import struct

import numpy as np

__all__ = ["pcm16", "wav_header", "wav_file", "STREAMING_SIZE"]

STREAMING_SIZE = 0xFFFFFFFF  # the RIFF and data sizes of a WAV whose length is not known yet
_HEADER_BYTES = 44


def pcm16(audio: np.ndarray) -> bytes:
    """Float PCM in [-1, 1] as 16-bit little-endian samples (clipped, rounded to nearest)."""
    scaled = np.rint(np.clip(np.asarray(audio, dtype=np.float32), -1.0, 1.0) * 32767.0)
    return scaled.astype("<i2").tobytes()


def wav_header(sample_rate: int, data_bytes: int | None) -> bytes:
    """The 44-byte header of a mono 16-bit PCM WAV. ``data_bytes`` None: a stream whose
    length is open, its sizes ``0xFFFFFFFF`` as streaming WAV writers leave them (readers
    take the data to the end of the stream)."""
    if data_bytes is None:
        riff, data = STREAMING_SIZE, STREAMING_SIZE
    else:
        riff, data = _HEADER_BYTES - 8 + data_bytes, data_bytes
    return struct.pack(
        "<4sI4s4sIHHIIHH4sI", b"RIFF", riff, b"WAVE", b"fmt ", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16, b"data", data
    )


def wav_file(audio: np.ndarray, sample_rate: int) -> bytes:
    """A whole mono 16-bit WAV file of ``audio``."""
    body = pcm16(audio)
    return wav_header(sample_rate, len(body)) + body
