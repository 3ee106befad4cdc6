"""The codec as a stage in the caller's event loop: each stream's frames become PCM as
they arrive, several streams in one decoder call.

Why a stage of its own and not a step of the talker: the talker writes a frame per step
for every running stream, while the codec's cost is per call (its convolutions and
window attention are cheap per frame); batching whole chunks of several streams into
one call, and choosing the chunk sizes by what each listener has already received, is a
scheduling decision, made here. The codec's state per stream (the decoder's carried
context, a row of the slot store) makes chunked decoding exactly the one-shot decode.

Chunks follow the listener: a stream's first chunk is ``first_chunk_frames`` (a short
wait for the first sound); each later one is at most half of the audio the listener has
buffered and not yet played, so it is written and decoded before that audio runs out
whenever the talker is faster than real time, and chunks grow (fewer decoder calls) as
the buffer does, up to ``max_chunk_frames``.

Chunk lengths are powers of two (1, 2, 4, 8, 16, 32 frames by default): each target is
rounded down to one, and an ended stream's leftover goes out as its binary pieces (7
frames as 4, 2, 1) in successive calls, so on CUDA every call is a replay of one of the
codec's captured graphs (:mod:`~omni_async.speech.codec_graphs`). Streams' pasts live as
rows of the slot store (:class:`~omni_async.speech.codec_slots.CodecSlots`); a stream
takes its slot when its first chunk is decoded and gives it back when it closes, and
slots are taken, given back and grown only between calls (never while one is in flight).

Where the decoder runs: on a worker thread of its own, so the event loop never waits on
it (an eager decoder call is hundreds of kernel launches: ~20 ms of host time on the
H100's host, measured); on CUDA on a stream of its own, beside the talker's steps, its
PCM copied to the host and waited for on that thread. Slots are opened (their rows
zeroed, the store grown) and graphs captured on that thread and stream too, so every
device write to the store is in one stream's order.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np
import torch

from ..stage.executor import await_future
from .codec_base import StreamDecoder
from .admission import AudioRate
from .codec_graphs import CodecGraphs
from .codec_slots import CodecSlots
from .playback import Playback

__all__ = ["AudioChunk", "CodecStage", "CodecStream"]


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
    playback: Playback = field(default_factory=Playback)  # what its listener has been sent and played

    @property
    def first_audio_at(self) -> float | None:
        return self.playback.first_audio_at

    def urgency(self, frame_seconds: float) -> float:
        """Seconds before its listener runs dry counting the frames waiting here (smaller
        first); a stream before its first chunk comes before every playing one."""
        if self.playback.first_audio_at is None:
            return -1.0
        return self.playback.slack() + self.pending_frames * frame_seconds


class CodecStage:
    def __init__(self, decoder: StreamDecoder, device: torch.device, *, first_chunk_frames: int = 2, max_chunk_frames: int = 32,
                 cuda_graphs: bool = True, slots: int | None = None, max_streams_per_round: int | None = None,
                 max_frames_per_round: int | None = None, stream: Any = None) -> None:
        if first_chunk_frames < 1 or max_chunk_frames < first_chunk_frames:
            raise ValueError("chunk sizes: 1 <= first_chunk_frames <= max_chunk_frames")
        for name, cap in (("max_streams_per_round", max_streams_per_round), ("max_frames_per_round", max_frames_per_round)):
            if cap is not None and cap < 1:
                raise ValueError(f"{name} must be None or >= 1")
        # A round's budget, in streams and in frames: past either, the most urgent go first
        # (first chunks, then the least audio buffered) and the rest wait for the next
        # round. The frame budget bounds a round's time, so a new stream's first chunk
        # waits behind at most one bounded round, not a burst of every stream's long chunk.
        self.max_streams_per_round = max_streams_per_round
        self.max_frames_per_round = max_frames_per_round
        self.rounds = 0
        self.largest_round_frames = 0
        # Audio seconds decoded a second over rounds that left ready chunks for the next (the
        # admission gate's measure of what the codec can feed).
        self.audio_rate = AudioRate()
        # Called with each round's seconds on the loop (metrics).
        self.round_observers: list[Any] = []
        self.decoder, self.device = decoder, device
        self.first_chunk_frames, self.max_chunk_frames = first_chunk_frames, max_chunk_frames
        self.sample_rate: int = decoder.sample_rate
        self.frame_seconds = decoder.samples_per_frame / decoder.sample_rate
        # ``stream``: a CUDA stream to queue the calls on (another stage's, to run between its
        # steps); by default one of the codec's own.
        self._cuda_stream = stream if stream is not None else torch.cuda.Stream(device) if device.type == "cuda" else None
        # On CUDA room for 64 streams from the start (2.6 MB each at the released size in
        # bf16): a grow drops the captured graphs. The store and the graphs' inputs belong
        # to the codec's stream (made there, and the stream waits for their zeros), so
        # their memory is reused only in that stream's order.
        with self._on_codec_stream():
            self.slots = CodecSlots(decoder, slots or (64 if device.type == "cuda" else 8))
            self.graphs = CodecGraphs(self.slots) if device.type == "cuda" and cuda_graphs else None
        if self._cuda_stream is not None:
            self._cuda_stream.wait_stream(torch.cuda.current_stream(device))
        self._streams: dict[int, CodecStream] = {}
        self._wake = anyio.Event()
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._busy = False  # a call is in flight: slots given back wait for its end
        self._released: list[int] = []
        self.calls = 0
        self.frames_decoded = 0

    def capture_graphs(self) -> None:
        """Capture the codec's CUDA graphs now, for every call a round under the frame
        budget (``max_frames_per_round``, 256 frames without one) can make: a capture
        runs the decoder eagerly twice and synchronises the device, which, left to a
        request's first round of each (batch, frames) shape, cost that round hundreds of
        milliseconds and stalled the talker beside it. On the codec's stream; before the
        first call. The eager warm-ups' activations (the largest bucket's: hundreds of MB at
        the released size) stay in torch's cache after them, memory no replay uses: it goes
        back to the device (the graphs' own pool is kept)."""
        if self.graphs is None:
            return
        with self._on_codec_stream():
            self.graphs.capture_within(self.max_frames_per_round or 256, self.max_chunk_frames)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    def _on_codec_stream(self) -> Any:
        return torch.cuda.stream(self._cuda_stream) if self._cuda_stream is not None else contextlib.nullcontext()

    @property
    def graph_replays(self) -> int:
        return 0 if self.graphs is None else self.graphs.replays

    # ------------------------------------------------------------ streams

    def open(self, request_id: str, playback: Playback | None = None) -> CodecStream:
        """A stream for ``request_id``; ``playback``: its listener's player, if the caller
        made it earlier (from the request's arrival), else a new one."""
        send, receive = anyio.create_memory_object_stream(math.inf)
        stream = CodecStream(request_id, send, receive, playback=playback or Playback())
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
        if stream.slot is not None:
            if self._busy:
                self._released.append(stream.slot)
            else:
                self.slots.close(stream.slot)
            stream.slot = None

    def active(self) -> int:
        return len(self._streams)

    def streams_in_underrun(self) -> int:
        """Open streams whose listener has run out of audio now (each stream's player)."""
        now = time.perf_counter()
        return sum(1 for s in self._streams.values() if s.playback.in_underrun(now))

    async def feed(self, handle: Any, stream: CodecStream) -> None:
        """A talker request's frames into ``stream`` as its deltas arrive (each delta's
        hidden-state rows; the request's first row is its prefill's, no frame), then its
        end. A request that fails or is aborted closes the stream (its reader sees the
        end without a last chunk, and the request's error)."""
        skip = 1
        reason = None
        try:
            async for delta in handle:
                rows = delta.hidden_states
                if rows is not None and rows.shape[0] > skip:
                    self.push(stream, rows[skip:])
                    skip = 0
                elif rows is not None:
                    skip -= rows.shape[0]
                if delta.finished:
                    reason = delta.finish_reason
        except Exception:
            self.close(stream)
            return
        self.end(stream, reason)

    # ------------------------------------------------------------ the stage's loop

    async def run(self) -> None:
        """Decode whatever is ready, forever (cancel to stop)."""
        try:
            while True:
                await self._wake.wait()
                self._wake = anyio.Event()
                while True:
                    ready, cut = self._ready()
                    if not ready:
                        break
                    took = await self._decode(ready)
                    if cut:  # chunks were ready past this round's budget: the codec is the bound
                        self.audio_rate.observe(sum(n for _, n in ready) * self.frame_seconds, took)
        finally:
            if self._thread is not None:
                self._thread.shutdown(wait=False, cancel_futures=True)

    def _target(self, stream: CodecStream) -> int:
        """Frames of the stream's next chunk: the first is short; later ones at most half
        the audio the listener still has buffered (its player's slack), so the frames of a
        chunk are written while the audio before it plays, at any speed faster than real
        time; up to ``max_chunk_frames``; rounded down to a power of two (a captured
        graph's length)."""
        if stream.first_audio_at is None:
            return _power_of_two(self.first_chunk_frames)
        buffered = stream.playback.slack() / self.frame_seconds
        return _power_of_two(int(min(self.max_chunk_frames, max(self.first_chunk_frames, buffered // 2))))

    def _ready(self) -> tuple[list[tuple[CodecStream, int]], bool]:
        """Streams with a chunk to decode now, and how many frames each takes (an ended
        stream's leftover: its largest power of two now, the rest in the next calls), within
        the round's budgets; and whether the budgets left ready chunks for the next round."""
        out = []
        for s in list(self._streams.values()):
            want = self._target(s)
            if s.pending_frames >= want:
                out.append((s, want))
            elif s.ended:
                if s.pending_frames:
                    out.append((s, _power_of_two(s.pending_frames)))
                else:  # nothing left: the empty terminal chunk
                    self._deliver(s, torch.zeros((0, self.decoder.num_quantizers), dtype=torch.long),
                                  np.zeros(0, dtype=np.float32))
        kept = self._within_budget(out)
        return kept, len(kept) < len(out)

    def _within_budget(self, ready: list[tuple[CodecStream, int]]) -> list[tuple[CodecStream, int]]:
        """The most urgent of ``ready`` that fit the round's budgets (at least one)."""
        cap_streams, cap_frames = self.max_streams_per_round, self.max_frames_per_round
        over_streams = cap_streams is not None and len(ready) > cap_streams
        over_frames = cap_frames is not None and sum(n for _, n in ready) > cap_frames
        if not (over_streams or over_frames):
            return ready
        kept: list[tuple[CodecStream, int]] = []
        frames = 0
        for s, n in sorted(ready, key=lambda item: item[0].urgency(self.frame_seconds)):
            if kept and ((cap_streams is not None and len(kept) >= cap_streams) or (cap_frames is not None and frames + n > cap_frames)):
                break
            kept.append((s, n))
            frames += n
        return kept

    @staticmethod
    def _take(stream: CodecStream, n: int) -> torch.Tensor:
        rows = torch.cat(stream.pending) if len(stream.pending) > 1 else stream.pending[0]
        chunk, rest = rows[:n], rows[n:]
        stream.pending = [rest] if rest.shape[0] else []
        stream.pending_frames -= n
        return chunk.to(torch.long)

    async def _decode(self, ready: list[tuple[CodecStream, int]]) -> float:
        """One round: the ready streams' chunks, one call per chunk length, on the codec's
        thread. What the thread needs is read here, on the loop (a stream closed while the
        call runs gives its slot back only after the call); streams new to the codec get
        their slots there, in the order of the codec's device work."""
        groups: dict[int, list[tuple[CodecStream, torch.Tensor]]] = {}
        for s, n in ready:
            groups.setdefault(n, []).append((s, self._take(s, n)))
        known = {id(s): s.slot for s, _ in ready if s.slot is not None}
        new = [id(s) for s, _ in ready if s.slot is None]
        calls = [([id(s) for s, _ in group], [chunk for _, chunk in group]) for group in groups.values()]
        taken = None
        if self._cuda_stream is not None:  # the chunks were cut on this thread's stream
            taken = torch.cuda.Event()
            taken.record()
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="omni-codec")
        self._busy = True
        started = time.perf_counter()
        try:
            opened, done = await await_future(self._thread.submit(self._decode_off_loop, known, new, calls, taken))
        finally:
            self._busy = False
            released, self._released = self._released, []
            for slot in released:
                self.slots.close(slot)
        took = time.perf_counter() - started
        self.rounds += 1
        self.largest_round_frames = max(self.largest_round_frames, sum(n for _, n in ready))
        for observe in self.round_observers:
            observe(took)
        for s, _ in ready:
            if id(s) in opened:
                if s.closed:  # closed during its first call: the slot it was given goes back
                    self.slots.close(opened[id(s)])
                else:
                    s.slot = opened[id(s)]
        for group, (codes, pcm) in zip(groups.values(), done):
            for j, (s, _) in enumerate(group):
                self.frames_decoded += int(codes.shape[1])
                if not s.closed:
                    self._deliver(s, codes[j], pcm[j])
        return took

    def _decode_off_loop(self, known: dict[int, int], new: list[int], calls: list[tuple[list[int], list[torch.Tensor]]],
                         taken: Any) -> tuple[dict[int, int], list[tuple[torch.Tensor, np.ndarray]]]:
        """A round's calls on the codec's thread (streams by id): slots opened for the new
        streams, then a call per chunk length; on CUDA on the stage's stream (beside the
        talker's steps), the PCM copied to the host and waited for here, so the event loop
        never blocks on the codec's launches or its completion."""
        with torch.inference_mode(), self._on_codec_stream():
            if taken is not None:
                torch.cuda.current_stream(self.device).wait_event(taken)
            slots = dict(known)
            for key in new:
                slots[key] = self.slots.open()
            out = [self._call([slots[key] for key in keys], chunks) for keys, chunks in calls]
            if self._cuda_stream is not None:
                event = torch.cuda.Event(blocking=True)
                event.record()
        if self._cuda_stream is not None:
            event.synchronize()
        return {key: slots[key] for key in new}, [(codes, pcm.float().numpy()) for codes, pcm in out]

    def _call(self, slots: list[int], chunks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder call for streams (by slot) whose chunks have one length; its codes
        and PCM on their way to the host (the copy queued before the next call, which may
        reuse a graph's output memory)."""
        if self._cuda_stream is not None:  # made on the loop's stream, read on this one
            for chunk in chunks:
                chunk.record_stream(self._cuda_stream)
        codes = torch.stack(chunks)
        self.calls += 1
        pcm = self.graphs.run(codes, slots) if self.graphs is not None else self.slots.run(codes, slots)
        return codes.to("cpu", non_blocking=True), pcm.to("cpu", non_blocking=True)

    def _deliver(self, s: CodecStream, codes: torch.Tensor, pcm: np.ndarray) -> None:
        last = s.ended and s.pending_frames == 0
        if s.frames_sent == 0:  # a stream's first samples that are not audio (Code2Wav's lead)
            pcm = pcm[self.decoder.leading_samples:]
        chunk = AudioChunk(s.request_id, np.asarray(pcm, dtype=np.float32), self.sample_rate, codes, s.frames_sent, last,
                           s.finish_reason if last else None)
        s.frames_sent += int(codes.shape[0])
        s.playback.on_audio(chunk.seconds)
        if last:
            s.playback.finished = True
        try:
            s.send.send_nowait(chunk)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass
        if last:
            self.close(s)


def _power_of_two(n: int) -> int:
    """The largest power of two at most ``n`` (``n >= 1``)."""
    return 1 << (max(1, n).bit_length() - 1)
