"""Two stages chained in one event loop: stage A's per-step stream output becomes stage
B's ``stream_chunk`` input, A's finish becomes B's ``stream_done``.

Each stage hands a step's messages to the pipeline in one call (its output sink), and a
router task per stage routes them: to the conversation's handle, and from A on into B's
inbox. Passing a step at a time, not a message at a time through the stages' outboxes,
keeps the router off the loop thread's critical path when two stages share it.

Backpressure: a handle holds at most ``buffer`` unread events; a slow caller stalls the
router, which then stops feeding stage B as well (what it has not routed waits in the
pipeline's ``backlog``). Aborting a request (or a failure in either stage) aborts it in
both; the caller sees the error.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import anyio

from .. import errors
from ..messages import IncomingMessage, OutgoingMessage
from ..scheduler import AsyncOmniScheduler


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

    The router puts a step's events here in one go and wakes the reader once; it holds
    back (and so stops feeding the second stage) while ``buffer`` events wait unread."""

    def __init__(self, pipeline: "TwoStagePipeline", request_id: str, buffer: int) -> None:
        self.request_id = request_id
        self._pipeline = pipeline
        self._buffer = max(1, buffer)
        self._events: deque[StageEvent] = deque()
        self._readable = anyio.Event()
        self._space = anyio.Event()
        self._open = {pipeline.names[0], pipeline.names[1]}

    @property
    def buffered(self) -> int:
        """Events routed to this handle and not yet read."""
        return len(self._events)

    def _put(self, event: StageEvent) -> None:
        self._events.append(event)
        self._readable.set()

    async def _until_space(self) -> None:
        while len(self._events) >= self._buffer:
            self._space = anyio.Event()
            await self._space.wait()

    async def _next_batch(self) -> list[StageEvent]:
        while not self._events:
            self._readable = anyio.Event()
            await self._readable.wait()
        batch = list(self._events)
        self._events.clear()
        self._space.set()
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
                        self._pipeline.abort(self.request_id)
                        err = event.data
                        raise err if isinstance(err, BaseException) else errors.RequestFailedError(str(err))
                    yield event
        finally:
            if self._open:
                self._pipeline.abort(self.request_id)
                self._pipeline._handles.pop(self.request_id, None)

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
    ) -> None:
        self.first = first
        self.second = second
        self.names = names
        self.to_chunk = to_chunk
        self.buffer = buffer
        self._handles: dict[str, PipelineHandle] = {}
        self._task_group: Any = None
        # Each stage's step outputs as its sink hands them over (one list per step),
        # until the router task has routed them.
        self._steps = (StepQueue(), StepQueue())
        self.stacks: tuple[Any, ...] = ()  # what from_pretrained built, for introspection

    @classmethod
    def from_pretrained(
        cls,
        thinker: str = "tiny",
        talker: str = "tiny",
        *,
        device: str = "cpu",
        devices: tuple[str, str] | None = None,
        loop: str = "normal",
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
        self._task_group.start_soon(self._route_first)
        self._task_group.start_soon(self._route_second)
        return self

    @property
    def backlog(self) -> int:
        """Stage messages handed over by the stages and not yet routed (they wait while
        a handle's reader is behind)."""
        return sum(q.pending for q in self._steps)

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.first.aclose()
        await self.second.aclose()
        for steps in self._steps:
            steps.close()
        tg, self._task_group = self._task_group, None
        if tg is not None:
            await tg.__aexit__(*exc_info)

    async def submit(self, request_id: str, first_payload: Any, second_payload: Any) -> PipelineHandle:
        if request_id in self._handles:
            raise errors.RequestRejectedError(f"duplicate request id {request_id!r}")
        handle = PipelineHandle(self, request_id, self.buffer)
        self._handles[request_id] = handle
        await self.second.inbox.send(IncomingMessage(request_id, "new_request", second_payload))
        await self.first.inbox.send(IncomingMessage(request_id, "new_request", first_payload))
        return handle

    def abort(self, request_id: str) -> None:
        self.first.abort(request_id)
        self.second.abort(request_id)

    async def _deliver(self, stage: str, msg: OutgoingMessage) -> bool:
        handle = self._handles.get(msg.request_id)
        if handle is None:
            return False
        if handle.buffered >= handle._buffer:
            await handle._until_space()
        handle._put(StageEvent(stage, msg.type, msg.data))
        return True

    async def _route_first(self) -> None:
        async for msg in self._steps[0]:
            await self._deliver(self.names[0], msg)
            rid = msg.request_id
            if msg.type == "stream":
                self._send_second(IncomingMessage(rid, "stream_chunk", self.to_chunk(msg)))
            elif msg.type == "result":
                self._send_second(IncomingMessage(rid, "stream_done"))
            else:
                self.second.abort(rid)

    def _send_second(self, msg: IncomingMessage) -> None:
        try:
            self.second.inbox.send_nowait(msg)  # the inbox is unbounded
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass

    async def _route_second(self) -> None:
        async for msg in self._steps[1]:
            await self._deliver(self.names[1], msg)
            if msg.type == "error":
                self.first.abort(msg.request_id)
            if msg.type in ("result", "error"):
                handle = self._handles.get(msg.request_id)
                if handle is not None and self.names[0] not in handle._open:
                    self._handles.pop(msg.request_id, None)


class StepQueue:
    """A stage's output sink for the router: each step's messages appended in one call
    (on the loop thread, inside the stage's step), read back one by one by the router
    task, which is woken once per batch of steps rather than once per message."""

    def __init__(self) -> None:
        self._messages: deque[OutgoingMessage] = deque()
        self._ready = anyio.Event()
        self._closed = False

    @property
    def pending(self) -> int:
        return len(self._messages)

    def put(self, messages: list[OutgoingMessage]) -> None:
        self._messages.extend(messages)
        self._ready.set()

    def close(self) -> None:
        self._closed = True
        self._ready.set()

    async def __aiter__(self) -> AsyncIterator[OutgoingMessage]:
        messages = self._messages
        while True:
            while messages:
                yield messages.popleft()
            if self._closed:
                return
            self._ready = anyio.Event()
            await self._ready.wait()
