"""Two stages chained in one event loop: stage A's per-step stream output becomes stage
B's ``stream_chunk`` input, A's finish becomes B's ``stream_done``.

Each stage hands a step's messages to the pipeline in one call (its output sink), and a
router task per stage routes them: to the conversation's handle, and from A on into B's
inbox. Passing a step at a time, not a message at a time through the stages' outboxes,
keeps the router off the loop thread's critical path when two stages share it.

Back-pressure is per conversation: a handle holds at most ``buffer`` unread events; what
arrives behind them is held in the pipeline for that conversation alone (and the second
stage is not fed that conversation's chunks meanwhile), so a slow or absent reader stalls
only its own conversation, never the routing of the others. A conversation held back
with no read for ``stall_timeout`` seconds, or holding more than ``max_held`` events, is
aborted in both stages and its reader gets :class:`~omni_async.errors.ConsumerStalledError`.
A conversation leaves the pipeline (its id free again) once both stages' terminal
messages reached the router, read or not; from then on its handle (a late reader's)
acts on nothing in the pipeline, whatever conversation reuses the id. Aborting a request (or a failure in either
stage) aborts it in both; the caller sees the error.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import anyio

from .. import errors
from ..messages import IncomingMessage, OutgoingMessage
from ..scheduler import AsyncOmniScheduler
from .step_queue import StepQueue


@dataclass
class StageEvent:
    """One output of one stage: ``kind`` is ``stream``, ``result`` or ``error``."""

    stage: str
    kind: str
    data: Any


def delta_to_chunk(msg: OutgoingMessage) -> Any:
    """Default A->B chunk: the stream delta itself."""
    return msg.data


class PipelineHandle:
    """One conversation's events from both stages, in arrival order.

    The router puts events here while fewer than ``buffer`` wait unread and holds the
    rest back (``_held``); each read moves held events in (see
    :meth:`TwoStagePipeline._release`). The handle outlives its place in the pipeline: a
    reader that starts after both stages ended still gets every event."""

    def __init__(self, pipeline: "TwoStagePipeline", request_id: str, buffer: int) -> None:
        self.request_id = request_id
        self._pipeline = pipeline
        self._buffer = max(1, buffer)
        self._events: deque[StageEvent] = deque()
        self._readable = anyio.Event()
        self._open = {pipeline.names[0], pipeline.names[1]}  # the reader's view
        # The router's view: messages routed but not yet handed to the reader (index of
        # the stage, message), the stages whose terminal message has not reached the
        # router, whether the conversation left the pipeline, and whether nothing more
        # is kept for it (the reader left, or it was given up).
        self._held: deque[tuple[int, OutgoingMessage]] = deque()
        self._unended = {0, 1}
        self._left = False
        self._dropped = False

    @property
    def buffered(self) -> int:
        """Events routed to this handle and not yet read."""
        return len(self._events)

    @property
    def held(self) -> int:
        """Events routed for this conversation and held back behind ``buffered``."""
        return len(self._held)

    def _has_room(self) -> bool:
        return not self._held and len(self._events) < self._buffer

    def _put(self, event: StageEvent) -> None:
        self._events.append(event)
        self._readable.set()

    async def _next_batch(self) -> list[StageEvent]:
        while not self._events:
            self._readable = anyio.Event()
            await self._readable.wait()
        batch = list(self._events)
        self._events.clear()
        self._pipeline._release(self)
        return batch

    async def __aiter__(self) -> AsyncIterator[StageEvent]:
        """Events of both stages in arrival order; raises the first error after aborting
        the request in both stages."""
        try:
            while self._open:
                for event in await self._next_batch():
                    if event.kind in ("result", "error"):
                        self._open.discard(event.stage)
                    if event.kind == "error":
                        self._pipeline._abort_own(self)
                        err = event.data
                        raise err if isinstance(err, BaseException) else errors.RequestFailedError(str(err))
                    yield event
        finally:
            if self._open:  # the reader left early: nothing more is kept for it
                self._pipeline._drop(self)
                self._pipeline._abort_own(self)

    async def results(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        async for event in self:
            if event.kind == "result":
                out[event.stage] = event.data
        return out


class TwoStagePipeline:
    """Run two schedulers in one task group and route A's stream into B."""

    def __init__(
        self,
        first: AsyncOmniScheduler,
        second: AsyncOmniScheduler,
        *,
        names: tuple[str, str] = ("thinker", "talker"),
        to_chunk: Callable[[OutgoingMessage], Any] = delta_to_chunk,
        buffer: int = 64,
        stall_timeout: float = 30.0,
        max_held: int = 4096,
    ) -> None:
        """``buffer``: events a handle holds unread before its conversation is held back;
        ``stall_timeout``: seconds a held-back conversation may go without a read, and
        ``max_held``: events it may hold back, before it is aborted in both stages."""
        if stall_timeout <= 0 or max_held < 1:
            raise errors.ConfigError(f"stall_timeout must be > 0 and max_held >= 1, got {stall_timeout}, {max_held}")
        self.first = first
        self.second = second
        self.names = names
        self.to_chunk = to_chunk
        self.buffer = buffer
        self.stall_timeout = stall_timeout
        self.max_held = max_held
        self._handles: dict[str, PipelineHandle] = {}
        self._task_group: Any = None
        # Each stage's step outputs as its sink hands them over (one list per step),
        # until the router task has routed them.
        self._steps = (StepQueue(), StepQueue())
        # Held-back conversations, oldest stall first: id -> when it last had a read.
        self._stalled: dict[str, float] = {}
        self._stall_wake = anyio.Event()
        self._watch_scope: anyio.CancelScope | None = None
        self.stacks: tuple[Any, ...] = ()  # what from_pretrained built, for introspection

    @classmethod
    def from_pretrained(
        cls,
        thinker: str = "tiny",
        talker: str = "tiny",
        *,
        device: str = "cpu",
        devices: tuple[str, str] | None = None,
        loop: str | None = None,
        shares: tuple[float | int | None, float | int | None] = (None, None),
        dtype: Any = None,
        seeds: tuple[int, int] = (0, 1),
        talker_min_chunks: int = 3,
        talker_inputs: str = "hidden",
        talker_pad_id: int | None = None,
        capture_hidden: bool = True,
        thinker_limits: dict[str, Any] | None = None,
        talker_limits: dict[str, Any] | None = None,
        **pipeline: Any,
    ) -> "TwoStagePipeline":
        """Both stages on ``device``, or on ``devices=(thinker's, talker's)``, each within
        its share of its device's memory (``memory_budget``: a fraction of its total
        memory or bytes; None sizes that stage's KV as an engine would). ConfigError when
        the shares of one device add up to more than it (before anything loads) or one
        cannot hold its model and a minimum KV.

        The talker is deferred until ``talker_min_chunks`` thinker chunks arrived.
        ``talker_inputs="hidden"`` (the default): it reads the thinker's hidden states,
        one per thinker token, through its ``thinker_to_talker_proj`` (the talker
        checkpoint's, else random from its seed); its prompt is BOS and one placeholder
        (``talker_pad_id``, BOS by default) per thinker row so far, and each later
        position waits for its row (:func:`.colocate.talker_request_builder`).
        ``talker_inputs="tokens"``: its prompt is BOS and the thinker's tokens so far.
        ``capture_hidden``: thinker stream chunks carry their hidden states (needed by
        the hidden talker). ``pipeline``: this class's options."""
        from .colocate import build_stage_scheduler, build_talker, check_shares
        from ..errors import ConfigError

        thinker_device, talker_device = devices if devices is not None else (device, device)
        if talker_inputs == "hidden" and not capture_hidden:
            raise ConfigError("a talker fed by the thinker's hidden states needs capture_hidden=True")
        if thinker_device == talker_device:
            check_shares(shares)
        else:
            check_shares(shares[:1])
            check_shares(shares[1:])
        first, first_stack = build_stage_scheduler(
            thinker, device=thinker_device, loop=loop, dtype=dtype, seed=seeds[0], memory_budget=shares[0],
            capture_hidden=capture_hidden, **(thinker_limits or {}),
        )
        second, second_stack = build_talker(
            talker, min_chunks=talker_min_chunks, inputs=talker_inputs, pad_id=talker_pad_id,
            conditioning_size=first_stack.loaded.config.hidden_size, device=talker_device, loop=loop, dtype=dtype,
            seed=seeds[1], memory_budget=shares[1], **(talker_limits or {}),
        )
        pipe = cls(first, second, **pipeline)
        pipe.stacks = (first_stack, second_stack)
        return pipe

    async def __aenter__(self) -> "TwoStagePipeline":
        # Each stage hands its step's messages over in one call (no outbox, no task hop
        # per message); a router task per stage routes them.
        self.first.attach_output_sink(self._steps[0].put)
        self.second.attach_output_sink(self._steps[1].put)
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        await self._task_group.start(self.first.run)
        await self._task_group.start(self.second.run)
        self._task_group.start_soon(self._route, 0)
        self._task_group.start_soon(self._route, 1)
        await self._task_group.start(self._watch_stalls)
        return self

    @property
    def backlog(self) -> int:
        """Stage messages not yet handed to a reader: handed over by the stages and not
        yet routed, or routed and held back behind a reader that is behind."""
        return sum(q.pending for q in self._steps) + sum(len(h._held) for h in self._handles.values())

    async def __aexit__(self, *exc_info: Any) -> None:
        """Close both stages (each open request ends with an error), route what they
        sent, and stop. Never waits for a reader."""
        try:
            await self.first.aclose()
            await self.second.aclose()
        finally:
            for steps in self._steps:
                steps.close()
            if self._watch_scope is not None:
                self._watch_scope.cancel()
            tg, self._task_group = self._task_group, None
            if tg is not None:
                await tg.__aexit__(*exc_info)

    async def submit(self, request_id: str, first_payload: Any, second_payload: Any) -> PipelineHandle:
        if request_id in self._handles:
            raise errors.RequestRejectedError(f"duplicate request id {request_id!r}: a conversation with this id is open")
        handle = PipelineHandle(self, request_id, self.buffer)
        self._handles[request_id] = handle
        try:
            await self.second.inbox.send(IncomingMessage(request_id, "new_request", second_payload))
        except BaseException:
            self._handles.pop(request_id, None)
            raise
        try:
            await self.first.inbox.send(IncomingMessage(request_id, "new_request", first_payload))
        except BaseException:
            self.second.abort(request_id)  # its terminal takes the conversation out
            handle._unended.discard(0)
            raise
        return handle

    def abort(self, request_id: str) -> None:
        self.first.abort(request_id)
        self.second.abort(request_id)

    def _owns(self, handle: PipelineHandle) -> bool:
        """Whether ``handle``'s conversation is the one its id names in the pipeline now:
        once it has left, the id may belong to a new conversation, which a late reader
        of the old handle must never touch."""
        return self._handles.get(handle.request_id) is handle

    def _abort_own(self, handle: PipelineHandle) -> None:
        """Abort ``handle``'s conversation in both stages, if it is still in the pipeline
        (one that left has ended in both already)."""
        if self._owns(handle):
            self.abort(handle.request_id)

    # ------------------------------------------------------------ routing

    async def _route(self, stage: int) -> None:
        """The router of one stage's output: never waits on a reader."""
        async for msg in self._steps[stage]:
            self._route_one(stage, msg)

    def _route_one(self, stage: int, msg: OutgoingMessage) -> None:
        rid = msg.request_id
        if msg.type == "error":  # a failure in one stage ends the conversation in both
            (self.second if stage == 0 else self.first).abort(rid)
        handle = self._handles.get(rid)
        if handle is None:  # not the pipeline's conversation: the stages' own traffic
            if stage == 0:
                self._feed_second(msg)
            return
        if msg.type in ("result", "error"):
            handle._unended.discard(stage)
        if handle._dropped:
            pass
        elif handle._has_room():
            self._hand_over(handle, stage, msg)
        else:
            handle._held.append((stage, msg))
            self._on_held(handle)
        if not handle._unended:
            self._leave(handle)

    def _hand_over(self, handle: PipelineHandle, stage: int, msg: OutgoingMessage) -> None:
        """To the reader; the first stage's output also on into the second stage (the
        same conversation only while it is in the pipeline: its id may be reused after)."""
        handle._put(StageEvent(self.names[stage], msg.type, msg.data))
        if stage == 0 and not handle._left:
            self._feed_second(msg)

    def _feed_second(self, msg: OutgoingMessage) -> None:
        rid = msg.request_id
        if msg.type == "stream":
            self._send_second(IncomingMessage(rid, "stream_chunk", self.to_chunk(msg)))
        elif msg.type == "result":
            self._send_second(IncomingMessage(rid, "stream_done"))

    def _send_second(self, msg: IncomingMessage) -> None:
        try:
            self.second.inbox.send_nowait(msg)  # the inbox is unbounded
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass

    def _leave(self, handle: PipelineHandle) -> None:
        """Both stages ended the conversation: it leaves the pipeline (the handle keeps
        its events for the reader) and its id is free."""
        handle._left = True
        if self._handles.get(handle.request_id) is handle:
            del self._handles[handle.request_id]
        self._stalled.pop(handle.request_id, None)

    # ------------------------------------------------------------ back-pressure

    def _release(self, handle: PipelineHandle) -> None:
        """The reader took its events: held ones move in, up to ``buffer``."""
        held = handle._held
        while held and len(handle._events) < handle._buffer:
            stage, msg = held.popleft()
            self._hand_over(handle, stage, msg)
        if not self._owns(handle):  # it left: the stall entry under its id is another's
            return
        rid = handle.request_id
        self._stalled.pop(rid, None)
        if held:
            self._stalled[rid] = anyio.current_time()  # a read: its deadline starts again

    def _on_held(self, handle: PipelineHandle) -> None:
        rid = handle.request_id
        if len(handle._held) > self.max_held:
            self._give_up(handle, f"its reader left {len(handle._held)} events unread (max_held={self.max_held})")
        elif rid not in self._stalled:
            self._stalled[rid] = anyio.current_time()
            self._stall_wake.set()

    def _drop(self, handle: PipelineHandle) -> None:
        """Keep nothing more for this conversation (its terminals still take it out)."""
        handle._dropped = True
        handle._held.clear()
        if self._owns(handle):
            self._stalled.pop(handle.request_id, None)

    def _give_up(self, handle: PipelineHandle, why: str) -> None:
        rid = handle.request_id
        self._drop(handle)
        handle._put(StageEvent("pipeline", "error", errors.ConsumerStalledError(
            f"conversation {rid!r} aborted: {why}; read its handle, or raise the pipeline's buffer, "
            "stall_timeout or max_held")))
        self.abort(rid)

    async def _watch_stalls(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """Abort each conversation held back with no read for ``stall_timeout``."""
        with anyio.CancelScope() as scope:
            self._watch_scope = scope
            task_status.started()
            while True:
                if not self._stalled:
                    self._stall_wake = anyio.Event()
                    await self._stall_wake.wait()
                    continue
                rid, since = next(iter(self._stalled.items()))
                wait = since + self.stall_timeout - anyio.current_time()
                if wait > 0:
                    await anyio.sleep(wait)
                    continue
                del self._stalled[rid]
                handle = self._handles.get(rid)
                if handle is not None:
                    self._give_up(handle, f"its reader read nothing for {self.stall_timeout:g} s "
                                  f"with {len(handle._held)} events held back (stall_timeout={self.stall_timeout:g})")
