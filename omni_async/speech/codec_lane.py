"""A lane of the codec stage: one worker thread, and on CUDA one stream, running codec
calls in order and handing each call's codes and PCM back to the event loop as soon as
they are on the host, not at the end of the work they came in.

Why per call: a round of the codec stage is several calls (one per chunk length) and takes
tens of milliseconds at 64 streams; a chunk whose call is done early in the round used to
wait for the whole round. Here the lane launches every call of its work back to back (on
CUDA the device never idles between them), records an event after each call's copy to the
host, and resolves that call's future as soon as its event is done: at once for the calls
already done after each launch, in order at the end for the rest. On a CPU a call is its
own completion.

What a lane does to the slot store (:class:`~omni_async.speech.codec_slots.CodecSlots`)
is device work in its own stream's order: zeroing the rows of slots the loop reserved for
its new streams (``LaneWork.reset``) and its calls' gathers and scatters on its streams'
rows. Which slot is whose is decided on the loop. The one exception is ``LaneWork.grow``
(slots opened here, growing the store when it is full); the codec stage asks for it only
in work that no other lane runs beside (see :mod:`~omni_async.speech.codec_stage`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import anyio
import numpy as np
import torch

from ..stage.executor import await_future
from .codec_graphs import CodecGraphs
from .codec_slots import CodecSlots

__all__ = ["CallDone", "CodecLane", "LaneCall", "LaneWork", "cut_marker"]


@dataclass
class LaneCall:
    """One decoder call: the chunks (``[frames, 16]`` codes, one length, on the device) of
    the streams ``keys`` (the caller's keys, one chunk each)."""

    keys: list[int]
    chunks: list[torch.Tensor]


@dataclass
class LaneWork:
    """What one submit to a lane runs, in this order: wait for ``taken`` (a CUDA event: the
    chunks were cut on the loop's stream), zero the ``reset`` slots, open a slot for each
    key of ``grow`` (the store may grow), run ``prepare``, then the ``calls``. ``slots``:
    the slot of every other key."""

    calls: list[LaneCall]
    slots: dict[int, int]
    reset: list[int] = field(default_factory=list)
    grow: list[int] = field(default_factory=list)
    prepare: Callable[[], None] | None = None
    taken: Any = None


@dataclass
class CallDone:
    """A call's result on the host: the slots its streams had (in ``LaneCall.keys`` order),
    its codes ``[B, F, 16]`` and PCM ``[B, samples]``."""

    slots: list[int]
    codes: torch.Tensor
    pcm: np.ndarray


class CodecLane:
    """Codec calls on one thread (made at the first submit), on ``stream`` on CUDA (None: a
    CPU, or the thread's current stream), through ``graphs`` when given (else eager calls
    on the store). ``busy`` from a submit until the loop has seen its work end."""

    def __init__(self, name: str, slots: CodecSlots, graphs: CodecGraphs | None, stream: Any, device: torch.device) -> None:
        self.name, self.slots, self.graphs, self.stream, self.device = name, slots, graphs, stream, device
        self.busy = False
        self._idle = anyio.Event()
        self._idle.set()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def on_stream(self) -> Any:
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    async def run(self, work: LaneWork, each: Callable[[LaneCall, CallDone], None]) -> None:
        """Run ``work`` on the lane's thread; ``each(call, done)`` on the loop as each call's
        PCM reaches the host, in call order; return once the work is over."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=self.name)
        futures: list[concurrent.futures.Future[CallDone]] = [concurrent.futures.Future() for _ in work.calls]
        self.busy, self._idle = True, anyio.Event()
        try:
            job = self._pool.submit(self._work, work, futures)
            for call, fut in zip(work.calls, futures):
                each(call, await await_future(fut))
            await await_future(job)
        finally:
            self.busy = False
            self._idle.set()

    async def idle(self) -> None:
        """Until no work of this lane is in flight."""
        while self.busy:
            await self._idle.wait()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    # ------------------------------------------------------------ on the lane's thread

    def _work(self, work: LaneWork, futures: list[concurrent.futures.Future[CallDone]]) -> None:
        pending: collections.deque[tuple[concurrent.futures.Future[CallDone], list[int], torch.Tensor, torch.Tensor, Any]]
        pending = collections.deque()
        try:
            with torch.inference_mode(), self.on_stream():
                if work.taken is not None:
                    torch.cuda.current_stream(self.device).wait_event(work.taken)
                slots = dict(work.slots)
                for slot in work.reset:
                    self.slots.reset(slot)
                for key in work.grow:
                    slots[key] = self.slots.open()
                if work.prepare is not None:
                    work.prepare()
                for call, fut in zip(work.calls, futures):
                    ids = [slots[key] for key in call.keys]
                    codes, pcm = self._call(ids, call.chunks)
                    pending.append((fut, ids, codes, pcm, self._mark()))
                    self._hand_back(pending, wait=False)
            self._hand_back(pending, wait=True)
        except BaseException as exc:
            for fut in futures:
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    fut.set_exception(exc)
            raise

    def _call(self, slots: list[int], chunks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder call; its codes and PCM on their way to the host (the copy queued
        before the next call, which may reuse a graph's output memory)."""
        if self.stream is not None:  # made on the loop's stream, read on this one
            for chunk in chunks:
                chunk.record_stream(self.stream)
        codes = torch.stack(chunks)
        pcm = self.graphs.run(codes, slots) if self.graphs is not None else self.slots.run(codes, slots)
        return codes.to("cpu", non_blocking=True), pcm.to("cpu", non_blocking=True)

    def _mark(self) -> Any:
        """A completion marker after the call just queued (None on a CPU: it is done)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(blocking=True)
        event.record()
        return event

    @staticmethod
    def _hand_back(pending: collections.deque, *, wait: bool) -> None:
        """Resolve the leading calls whose PCM is on the host (waiting for each when
        ``wait``): in order, so the loop sees calls in the order they ran."""
        while pending:
            fut, ids, codes, pcm, event = pending[0]
            if event is not None and not wait and not event.query():
                return
            if event is not None:
                event.synchronize()
            pending.popleft()
            with contextlib.suppress(concurrent.futures.InvalidStateError):  # its waiter was cancelled
                fut.set_result(CallDone(ids, codes, pcm.float().numpy()))


def cut_marker(device: torch.device) -> Any:
    """On CUDA an event after the work queued so far on the current stream (the chunks
    just cut on the loop's: a lane's stream waits for it); None on a CPU."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event
