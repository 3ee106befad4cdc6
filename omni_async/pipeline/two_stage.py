"""Two stages chained in one event loop: stage A's per-step stream output becomes stage
B's ``stream_chunk`` input, A's finish becomes B's ``stream_done``.

Backpressure: each request's events reach the caller through a bounded channel; a slow
caller stalls the router, which then stops feeding stage B as well. Aborting a request
(or a failure in either stage) aborts it in both; the caller sees the error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import anyio

from .. import errors
from ..messages import IncomingMessage, OutgoingMessage
from ..scheduler import AsyncOmniScheduler
from ..stage.channels import drain_stream


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
    def __init__(self, pipeline: "TwoStagePipeline", request_id: str, buffer: int) -> None:
        self.request_id = request_id
        self._pipeline = pipeline
        self._tx, self._rx = anyio.create_memory_object_stream[StageEvent](buffer)
        self._open = {pipeline.names[0], pipeline.names[1]}

    async def __aiter__(self) -> AsyncIterator[StageEvent]:
        """Events of both stages in arrival order; raises the first error after aborting
        the request in both stages."""
        try:
            while self._open:
                event = await self._rx.receive()
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
        self.stacks: tuple[Any, ...] = ()  # what from_pretrained built, for introspection

    @classmethod
    def from_pretrained(
        cls,
        thinker: str = "tiny",
        talker: str = "tiny",
        *,
        device: str = "cpu",
        loop: str = "normal",
        shares: tuple[float | int | None, float | int | None] = (None, None),
        dtype: Any = None,
        seeds: tuple[int, int] = (0, 1),
        talker_min_chunks: int = 3,
        capture_hidden: bool = True,
        thinker_limits: dict[str, Any] | None = None,
        talker_limits: dict[str, Any] | None = None,
        **pipeline: Any,
    ) -> "TwoStagePipeline":
        """Both stages on one device, each within its share of the device's memory
        (``memory_budget``: a fraction of its total memory or bytes; None sizes that
        stage's KV as an engine would). ConfigError when the shares add up to more than
        the device (before anything loads) or one cannot hold its model and a minimum
        KV. The talker is deferred until ``talker_min_chunks`` thinker chunks arrived;
        its prompt is BOS and the thinker's tokens so far. ``capture_hidden``: thinker
        stream chunks carry their hidden states. ``pipeline``: this class's options."""
        from .colocate import build_stage_scheduler, build_talker, check_shares

        check_shares(shares)
        first, first_stack = build_stage_scheduler(
            thinker, device=device, loop=loop, dtype=dtype, seed=seeds[0], memory_budget=shares[0],
            capture_hidden=capture_hidden, **(thinker_limits or {}),
        )
        second, second_stack = build_talker(
            talker, min_chunks=talker_min_chunks, device=device, loop=loop, dtype=dtype, seed=seeds[1],
            memory_budget=shares[1], **(talker_limits or {}),
        )
        pipe = cls(first, second, **pipeline)
        pipe.stacks = (first_stack, second_stack)
        return pipe

    async def __aenter__(self) -> "TwoStagePipeline":
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        await self._task_group.start(self.first.run)
        await self._task_group.start(self.second.run)
        self._task_group.start_soon(self._route_first)
        self._task_group.start_soon(self._route_second)
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.first.aclose()
        await self.second.aclose()
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
        try:
            await handle._tx.send(StageEvent(stage, msg.type, msg.data))
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            return False
        return True

    async def _route_first(self) -> None:
        async for msg in drain_stream(self.first.outbox):
            await self._deliver(self.names[0], msg)
            rid = msg.request_id
            if msg.type == "stream":
                await self._send_second(IncomingMessage(rid, "stream_chunk", self.to_chunk(msg)))
            elif msg.type == "result":
                await self._send_second(IncomingMessage(rid, "stream_done"))
            else:
                self.second.abort(rid)

    async def _send_second(self, msg: IncomingMessage) -> None:
        try:
            await self.second.inbox.send(msg)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass

    async def _route_second(self) -> None:
        async for msg in drain_stream(self.second.outbox):
            await self._deliver(self.names[1], msg)
            if msg.type == "error":
                self.first.abort(msg.request_id)
            if msg.type in ("result", "error"):
                handle = self._handles.get(msg.request_id)
                if handle is not None and self.names[0] not in handle._open:
                    self._handles.pop(msg.request_id, None)
