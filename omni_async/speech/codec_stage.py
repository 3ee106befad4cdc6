"""The codec as a stage in the caller's event loop: each stream's frames become PCM as
they arrive, several streams in one decoder call.

Why a stage of its own and not a step of the talker: the talker writes a frame per step
for every running stream, while the codec's cost is per call (its convolutions and
window attention are cheap per frame); batching whole chunks of several streams into
one call, and choosing the chunk sizes by what each listener has already received, is a
scheduling decision, made here. The codec's state per stream (the decoder's carried
context, :class:`CodecState`) makes chunked decoding exactly the one-shot decode.

Chunks follow the listener: a stream's first chunk is ``first_chunk_frames`` (a short
wait for the first sound); each later one is at most half of the audio the listener has
buffered and not yet played, so it is written and decoded before that audio runs out
whenever the talker is faster than real time, and chunks grow (fewer decoder calls) as
the buffer does, up to ``max_chunk_frames``.

Where the decoder runs: on CUDA its kernels are launched from the loop thread and the
completion awaited cooperatively (the talker's steps and the codec's calls interleave on
the device, neither holds the GIL while the other computes); on CPU, where a call is
blocking compute, on one worker thread of its own.
"""

from __future__ import annotations

import concurrent.futures
import math
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np
import torch

from ..stage.executor import EventWaiter, await_future

__all__ = ["AudioChunk", "CodecStage", "CodecStream"]


@dataclass
class AudioChunk:
    """A stretch of one stream's audio: ``audio`` float32 PCM in [-1, 1] at
    ``sample_rate``, decoded from ``codes`` (``[frames, 16]``, on the CPU), the stream's
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
    state: Any
    send: Any
    receive: Any
    pending: list[torch.Tensor] = field(default_factory=list)  # frame rows on the device
    pending_frames: int = 0
    frames_sent: int = 0
    ended: bool = False  # the talker is done with it (no more frames)
    finish_reason: str | None = None
    closed: bool = False
    created: float = field(default_factory=time.perf_counter)
    first_audio_at: float | None = None


class CodecStage:
    def __init__(self, decoder: Any, device: torch.device, *, first_chunk_frames: int = 2, max_chunk_frames: int = 16,
                 event_wait: str = "auto") -> None:
        if first_chunk_frames < 1 or max_chunk_frames < first_chunk_frames:
            raise ValueError("chunk sizes: 1 <= first_chunk_frames <= max_chunk_frames")
        self.decoder, self.device = decoder, device
        self.first_chunk_frames, self.max_chunk_frames = first_chunk_frames, max_chunk_frames
        self.sample_rate: int = decoder.sample_rate
        self.frame_seconds = decoder.samples_per_frame / decoder.sample_rate
        self._streams: dict[int, CodecStream] = {}
        self._wake = anyio.Event()
        self._waiter = EventWaiter(event_wait) if device.type == "cuda" else None
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self.calls = 0
        self.frames_decoded = 0

    # ------------------------------------------------------------ streams

    def open(self, request_id: str) -> CodecStream:
        send, receive = anyio.create_memory_object_stream(math.inf)
        stream = CodecStream(request_id, self.decoder.new_state(), send, receive)
        self._streams[id(stream)] = stream
        return stream

    def push(self, stream: CodecStream, frames: torch.Tensor) -> None:
        """``frames`` ``[n, 16]`` codes (any dtype holding the ids; on the device)."""
        if stream.closed or not frames.shape[0]:
            return
        stream.pending.append(frames)
        stream.pending_frames += int(frames.shape[0])
        self._wake.set()

    def end(self, stream: CodecStream, finish_reason: str | None) -> None:
        """No more frames will come: what is pending goes out as the last chunk."""
        stream.ended, stream.finish_reason = True, finish_reason
        self._wake.set()

    def close(self, stream: CodecStream) -> None:
        """Drop the stream now (its listener left, or it ended): its state and frames go."""
        stream.closed = True
        stream.pending.clear()
        self._streams.pop(id(stream), None)
        stream.send.close()

    def active(self) -> int:
        return len(self._streams)

    # ------------------------------------------------------------ the stage's loop

    async def run(self) -> None:
        """Decode whatever is ready, forever (cancel to stop)."""
        try:
            while True:
                await self._wake.wait()
                self._wake = anyio.Event()
                while True:
                    ready = self._ready()
                    if not ready:
                        break
                    await self._decode(ready)
        finally:
            if self._thread is not None:
                self._thread.shutdown(wait=False, cancel_futures=True)
            if self._waiter is not None:
                self._waiter.close()

    def _target(self, stream: CodecStream) -> int:
        """Frames of the stream's next chunk: the first is short; later ones at most half
        the audio the listener still has buffered (estimated from when its first chunk
        went out), so the frames of a chunk are written while the audio before it plays,
        at any speed faster than real time; up to ``max_chunk_frames``."""
        if stream.first_audio_at is None:
            return self.first_chunk_frames
        played = (time.perf_counter() - stream.first_audio_at) / self.frame_seconds
        buffered = stream.frames_sent - played
        return int(min(self.max_chunk_frames, max(self.first_chunk_frames, buffered // 2)))

    def _ready(self) -> list[tuple[CodecStream, int]]:
        """Streams with a chunk to decode now, and how many frames each takes."""
        out = []
        for s in list(self._streams.values()):
            want = self._target(s)
            if s.pending_frames >= want:
                out.append((s, want))
            elif s.ended:
                if s.pending_frames:
                    out.append((s, s.pending_frames))
                else:  # nothing left: the empty terminal chunk
                    self._deliver(s, torch.zeros((0, 16), dtype=torch.long), np.zeros(0, dtype=np.float32))
        return out

    @staticmethod
    def _take(stream: CodecStream, n: int) -> torch.Tensor:
        rows = torch.cat(stream.pending) if len(stream.pending) > 1 else stream.pending[0]
        chunk, rest = rows[:n], rows[n:]
        stream.pending = [rest] if rest.shape[0] else []
        stream.pending_frames -= n
        return chunk.to(torch.long)

    async def _decode(self, ready: list[tuple[CodecStream, int]]) -> None:
        streams = [s for s, _ in ready]
        chunks = [self._take(s, n) for s, n in ready]
        states = [s.state for s in streams]
        self.calls += 1
        if self._waiter is None:  # CPU: blocking compute on the codec's own thread
            if self._thread is None:
                self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="omni-codec")
            pcm, codes = await await_future(self._thread.submit(self._decode_on_host, chunks, states))
        else:
            with torch.inference_mode():
                out = self.decoder.decode_streams(chunks, states)
                pcm = [p.to("cpu", non_blocking=True) for p in out]
                codes = [c.to("cpu", non_blocking=True) for c in chunks]
                event = torch.cuda.Event()
                event.record()
            await self._waiter.wait(event)
            pcm = [p.numpy() for p in pcm]
        for s, c, p in zip(streams, codes, pcm):
            self.frames_decoded += int(c.shape[0])
            if not s.closed:
                self._deliver(s, c, p)

    def _decode_on_host(self, chunks: list[torch.Tensor], states: list[Any]) -> tuple[list[np.ndarray], list[torch.Tensor]]:
        with torch.inference_mode():
            out = self.decoder.decode_streams(chunks, states)
        return [p.float().numpy() for p in out], [c.cpu() for c in chunks]

    def _deliver(self, s: CodecStream, codes: torch.Tensor, pcm: np.ndarray) -> None:
        last = s.ended and s.pending_frames == 0
        chunk = AudioChunk(s.request_id, np.asarray(pcm, dtype=np.float32), self.sample_rate, codes, s.frames_sent, last,
                           s.finish_reason if last else None)
        s.frames_sent += int(codes.shape[0])
        if s.first_audio_at is None and len(chunk.audio):
            s.first_audio_at = time.perf_counter()
        try:
            s.send.send_nowait(chunk)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass
        if last:
            self.close(s)
