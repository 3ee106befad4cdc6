"""The codec as a stage in the caller's event loop: each stream's frames become PCM as
they arrive, several streams in one decoder call.

Why a stage of its own and not a step of the talker: the talker writes a frame per step
for every running stream, while the codec's cost is per call (its convolutions and
window attention are cheap per frame); batching whole chunks of several streams into
one call, and choosing the chunk sizes by what each listener has already received, is a
scheduling decision, made here. The codec's state per stream (the decoder's carried
context, a row of the slot store) makes chunked decoding exactly the one-shot decode.

Chunks follow the listener (their lengths, and how a round's chunks become calls, are
:mod:`~omni_async.speech.codec_plan`'s): lengths are powers of two, so on CUDA every call is
a replay of one of the codec's captured graphs (:mod:`~omni_async.speech.codec_graphs`).
Streams' pasts live as rows of the slot store (:class:`~omni_async.speech.codec_slots.CodecSlots`);
a stream takes its slot when its first chunk is decoded and gives it back when it closes.

Where the decoder runs: on worker threads, so the event loop never waits on it (an eager
decoder call is hundreds of kernel launches: ~20 ms of host time on the H100's host,
measured), in two lanes (:class:`~omni_async.speech.codec_lane.CodecLane`):

- the bulk lane runs rounds: every ready chunk within the round's budgets, in the calls
  the round's plan makes, on CUDA on the codec's stream (beside the talker's steps). The call
  holding the most urgent chunk runs first (a first chunk is the most urgent), and each
  call's chunks go out as soon as its PCM is on the host, not at the round's end; the
  order of calls changes no audio (a stream is in one call a round).
- the express lane (``express``, on by default; off where the codec's calls queue on
  another stage's stream) takes first chunks that become ready
  while a round is in flight, up to 8 a call, so a new stream's first sound waits for one
  small call (a few ms) rather than for the round in flight and then its own. On CUDA it
  runs on a stream of higher priority than the bulk lane's (the talker's is higher still)
  with graphs of its own (batches 1 to 8 of the first chunk's length: their own static
  inputs, outputs and memory pool, padding on a scratch row of their own), so its replays
  touch no memory of the bulk lane's. It takes only streams whose first chunk is ready in
  full and for which a slot is free; the rest wait for a round, which takes first chunks
  first.

Which slot is whose is decided on the loop only (``CodecSlots.reserve``); a lane zeroes
its new streams' rows and runs its calls on its own stream, and a stream is in at most one
call at a time (``CodecStream.in_call``), so the lanes never write the same rows. A slot
comes back when its stream closes or, if a call of the stream is in flight, when that call
is done (its device work over before another stream zeroes the rows). What replaces the
store's tensors or captures graphs (growing the store when every slot is taken; capturing
the express lane's graphs, after a grow or when never captured) runs only in an exclusive
round on the bulk lane: the express lane finishes its call first and sits the round out,
and slots closed meanwhile come back after it. A grow is rare (room for 64 streams on CUDA
from the start).
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from typing import Any

import anyio
import numpy as np
import torch

from ..runners.streams import STREAMS
from .admission import AudioRate
from .codec_base import StreamDecoder
from .codec_graphs import CallShapes, CodecGraphs
from .codec_lane import CallDone, CodecLane, LaneCall, LaneWork, cut_marker
from .codec_slots import CodecSlots
from .codec_plan import ROUND_PLANS, Calls, chunk_target, plan_calls, within_budget
from .codec_streams import AudioChunk, CodecStream, power_of_two
from .playback import Playback

__all__ = ["AudioChunk", "CodecStage", "CodecStream", "EXPRESS_BATCHES"]

EXPRESS_BATCHES = (1, 2, 4, 8)  # the express lane's calls: at most 8 first chunks
EXPRESS_PRIORITY = -1  # its CUDA stream's: above the bulk lane's (0), below the talker's


class CodecStage:
    def __init__(self, decoder: StreamDecoder, device: torch.device, *, first_chunk_frames: int = 2, max_chunk_frames: int = 32,
                 cuda_graphs: bool = True, slots: int | None = None, max_streams_per_round: int | None = None,
                 max_frames_per_round: int | None = None, stream: Any = None, express: bool = True, sms: int | None = None,
                 round_plan: str = "merged") -> None:
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
        if round_plan not in ROUND_PLANS:
            raise ValueError(f"round_plan must be one of {ROUND_PLANS}, got {round_plan!r}")
        self.round_plan = round_plan  # how a round's chunks become calls (codec_plan.py)
        self.max_frames_per_round = max_frames_per_round
        self.rounds = 0
        self.largest_round_frames = 0
        # Audio seconds decoded a second over rounds that left ready chunks for the next (the
        # admission gate's measure of what the codec can feed).
        self.audio_rate = AudioRate()
        # Called with each round's seconds on the loop (metrics).
        self.round_observers: list[Any] = []
        # First chunks that become ready while a round is in flight take the express lane.
        self.express = express
        self._lanes_apart = stream is None  # (on another stage's stream the stages run one at a time: no express beside)
        self.express_calls = 0
        self.express_chunks = 0
        self.decoder, self.device = decoder, device
        self.first_chunk_frames, self.max_chunk_frames = first_chunk_frames, max_chunk_frames
        self._first_len = power_of_two(first_chunk_frames)
        self.sample_rate: int = decoder.sample_rate
        self.frame_seconds = decoder.samples_per_frame / decoder.sample_rate
        # ``stream``: a CUDA stream to queue the calls on (another stage's, to run between its
        # steps); by default one of the codec's own, confined to ``sms`` SMs if given (graphs too).
        cuda = device.type == "cuda"
        graphed = cuda and cuda_graphs
        self._cuda_stream = stream if stream is not None else STREAMS.take(device, 0, sms) if cuda else None
        express_stream = STREAMS.take(device, EXPRESS_PRIORITY, sms) if cuda else None
        # On CUDA room for 64 streams from the start (2.6 MB each at the released size in
        # bf16): a grow drops the captured graphs. The store and both lanes' graph inputs
        # belong to the codec's stream (made there, and the streams wait for their zeros),
        # so their memory is reused only in that stream's order; a second scratch row for
        # the express lane's padding.
        with self._on_codec_stream():
            self.slots = CodecSlots(decoder, slots or (64 if cuda else 8), scratch_rows=2 if graphed else 1)
            self.graphs = CodecGraphs(self.slots, sms=sms) if graphed else None
            self.express_graphs = CodecGraphs(self.slots, batches=EXPRESS_BATCHES, frames=(self._first_len,),
                                              scratch_row=1, sms=sms) if graphed else None
        if self._cuda_stream is not None:
            self._cuda_stream.wait_stream(torch.cuda.current_stream(device))
            express_stream.wait_stream(self._cuda_stream)
        self._bulk = CodecLane("omni-codec", self.slots, self.graphs, self._cuda_stream, device)
        self._express = CodecLane("omni-codec-express", self.slots, self.express_graphs, express_stream, device)
        self._streams: dict[int, CodecStream] = {}
        self._wake = anyio.Event()  # the bulk lane's: frames came, a stream ended, a call ended
        self._express_wake = anyio.Event()  # the express lane's: frames came, a round started
        self._exclusive = False  # a round that grows the store or captures graphs: no express call beside it
        self._released: list[int] = []  # slots closed during that round: back after it
        self.calls = self.frames_decoded = self.frames_padded = 0
        self.bulk_shapes, self.express_shapes = CallShapes(), CallShapes(EXPRESS_BATCHES)

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
            if self.express_graphs is not None and self._express_on():
                self.express_graphs.capture()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    def _express_on(self) -> bool:
        return self.express and self._lanes_apart

    def _on_codec_stream(self) -> Any:
        return torch.cuda.stream(self._cuda_stream) if self._cuda_stream is not None else contextlib.nullcontext()

    @property
    def graph_replays(self) -> int:
        return sum(g.replays for g in (self.graphs, self.express_graphs) if g is not None)

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
        self._express_wake.set()

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
        self._give_back(stream)

    def _give_back(self, stream: CodecStream) -> None:
        """A closed stream's slot back to the store: now, unless a call of it is in flight
        (then when that call is done: ``_call_done``) or an exclusive round runs (the bulk
        lane may be growing the store's free list: after that round)."""
        if stream.slot is None or stream.in_call:
            return
        if self._exclusive:
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
        skip, reason = 1, None
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
        """Decode whatever is ready, forever (cancel to stop): rounds on the bulk lane, first
        chunks beside them on the express lane."""
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._express_loop)
                await self._round_loop()
        finally:
            self._bulk.shutdown()
            self._express.shutdown()

    async def _round_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            while True:
                ready, spare, cut = self._ready()
                if not ready:
                    break
                calls = plan_calls(ready, spare, self.round_plan, self.max_streams_per_round, self.max_frames_per_round,
                                   self.max_chunk_frames, lambda s: s.urgency(self.frame_seconds))
                took = await self._decode(calls)
                if cut:  # chunks were ready past this round's budget: the codec is the bound
                    self.audio_rate.observe(sum(n * len(group) for n, group in calls) * self.frame_seconds, took)

    def _target(self, stream: CodecStream) -> int:
        return chunk_target(stream, self._first_len, self.first_chunk_frames, self.max_chunk_frames, self.frame_seconds)

    def _ready(self) -> tuple[list[tuple[CodecStream, int]], list[CodecStream], bool]:
        """Streams with a chunk to decode now, and how many frames each takes (an ended
        stream's last frames: the power of two at or above them, padded; past the longest
        chunk, the longest now and the rest in later rounds), within
        the round's budgets; the others with frames waiting, most urgent first (a plan may
        fill a call with them); and whether the budgets left ready chunks for the next
        round. A stream in a call (the express lane's) waits for it to end."""
        out, spare = [], []
        for s in list(self._streams.values()):
            if s.in_call:
                continue
            want = self._target(s)
            if s.pending_frames >= want:
                out.append((s, want))
            elif s.pending_frames and not s.ended:
                spare.append(s)
            elif s.ended:
                if s.pending_frames:  # its last frames, padded to a graph's length, or a long leftover's first piece
                    out.append((s, min(power_of_two(self.max_chunk_frames), 1 << (s.pending_frames - 1).bit_length())))
                else:  # nothing left: the empty terminal chunk
                    self._deliver(s, torch.zeros((0, self.decoder.num_quantizers), dtype=torch.long),
                                  np.zeros(0, dtype=np.float32))
        kept = within_budget(out, self.max_streams_per_round, self.max_frames_per_round, self.frame_seconds)
        taken = {id(s) for s, _ in kept}
        spare += [s for s, _ in out if id(s) not in taken]  # past the budgets now: due next round
        spare.sort(key=lambda s: s.urgency(self.frame_seconds))
        return kept, spare, len(kept) < len(out)

    def _calls(self, calls: Calls) -> list[LaneCall]:
        """A round's planned calls as the lane's, their chunks cut."""
        self.bulk_shapes.count_groups((len(group), n) for n, group in calls)
        return [LaneCall([id(s) for s in group], [s.cut(n) for s in group]) for n, group in calls]

    def _take_slot(self, stream: CodecStream, reset: list[int]) -> bool:
        """A free slot for a stream new to the codec, taken on the loop (its rows zeroed by
        the lane, in ``reset``); False when every slot is taken."""
        if stream.slot is None:
            slot = self.slots.reserve()
            if slot is None:
                return False
            stream.slot = slot
            reset.append(slot)
        return True

    async def _decode(self, planned: Calls) -> float:
        """One round on the bulk lane: its planned calls, each call's chunks delivered as it
        is done. Streams new to the codec take free slots here; those the store has no room
        for are opened on the lane (growing the store) in an exclusive round, which also
        captures the express lane's graphs when they are not current: the express lane
        finishes its call first and waits the round out."""
        streams = [s for _, group in planned for s in group]
        calls = self._calls(planned)
        reset: list[int] = []
        grow = [id(s) for s in streams if not self._take_slot(s, reset)]
        prepare = self._express_capture(bool(grow))
        exclusive = bool(grow) or prepare is not None
        if exclusive:
            self._exclusive = True
            await self._express.idle()
        work = LaneWork(calls, {id(s): s.slot for s in streams if s.slot is not None}, reset, grow, prepare, cut_marker(self.device))
        self._express_wake.set()  # a round in flight: first chunks from now take the express lane
        started = time.perf_counter()
        try:
            await self._bulk.run(work, functools.partial(self._call_done, {id(s): s for s in streams}))
        finally:
            if exclusive:
                self._end_exclusive()
        took = time.perf_counter() - started
        self.rounds += 1
        self.largest_round_frames = max(self.largest_round_frames, sum(n * len(group) for n, group in planned))
        for observe in self.round_observers:
            observe(took)
        return took

    def _express_capture(self, grows: bool) -> Any:
        """What a round runs to capture the express lane's graphs (its buckets), when the
        lane is on and they are not current or the round grows the store; else None."""
        graphs = self.express_graphs
        if graphs is None or not self._express_on() or (graphs.complete() and not grows):
            return None
        return graphs.capture

    def _end_exclusive(self) -> None:
        self._exclusive = False
        released, self._released = self._released, []
        for slot in released:
            self.slots.close(slot)
        self._express_wake.set()

    def _call_done(self, streams: dict[int, CodecStream], call: LaneCall, done: CallDone) -> None:
        """A call's PCM is on the host (on the loop): its streams' chunks go out, and a
        stream closed meanwhile gives back the slot it had or was given."""
        self.calls += 1
        for j, (key, slot) in enumerate(zip(call.keys, done.slots)):
            s = streams[key]
            s.in_call, s.slot = False, slot
            real = int(done.codes.shape[1]) - s.padding
            self.frames_decoded += real
            self.frames_padded += s.padding
            if s.closed:
                self._give_back(s)
            else:
                self._deliver(s, done.codes[j][:real], done.pcm[j][:real * self.decoder.samples_per_frame])

    # ------------------------------------------------------------ the express lane

    async def _express_loop(self) -> None:
        while True:
            await self._express_wake.wait()
            self._express_wake = anyio.Event()
            while (picked := self._express_ready()) is not None:
                work, streams = picked
                self.express_calls += 1
                self.express_chunks += len(streams)
                try:
                    await self._express.run(work, functools.partial(self._call_done, streams))
                finally:
                    self._wake.set()  # their next chunks are the bulk lane's

    def _express_ready(self) -> tuple[LaneWork, dict[int, CodecStream]] | None:
        """The express lane's next call, while a round is in flight (and not an exclusive
        one), its graphs current: the oldest streams whose first chunk is ready, up to 8,
        while the store has free slots for them; None when there is none."""
        graphs = self.express_graphs
        if not (self._express_on() and self._bulk.busy and not self._exclusive and (graphs is None or graphs.complete())):
            return None
        picked: list[CodecStream] = []
        reset: list[int] = []
        for s in self._streams.values():
            if len(picked) == EXPRESS_BATCHES[-1]:
                break
            if s.first_audio_at is None and not s.in_call and s.pending_frames >= self._first_len:
                if not self._take_slot(s, reset):
                    break  # the store is full: the bulk lane grows it
                picked.append(s)
        if not picked:
            return None
        call = LaneCall([id(s) for s in picked], [s.cut(self._first_len) for s in picked])
        self.express_shapes.count(len(picked), self._first_len)
        work = LaneWork([call], {id(s): s.slot for s in picked if s.slot is not None}, reset, taken=cut_marker(self.device))
        return work, {id(s): s for s in picked}

    def _deliver(self, s: CodecStream, codes: torch.Tensor, pcm: np.ndarray) -> None:
        if s.send_chunk(codes, pcm, self.sample_rate, self.decoder.leading_samples):
            self.close(s)
