"""Intake: arrivals, payload parsing, admission (each request built and checked through
the door, :mod:`omni_async.stage.request_checks`), stream input routing and tombstones.

Every inbox message is checked at the door: a malformed one gets an error message for
its sender where there is one and is dropped otherwise; a bad payload gets a typed error
on that request alone. Work per arrival is O(1) in the number of requests in the system.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Iterable

import anyio.lowlevel

from .. import errors
from .admission import Admission
from ..config import SchedulerConfig
from ..core.protocol import BatchCore
from ..core.request import RequestData
from ..logs import debug_enabled, log
from ..messages import IncomingMessage, RequestPayload
from ..structured.optimistic import enabled as optimistic_enabled
from .channels import WakeSignal
from .request_checks import RequestDoor, metadata_of, refuse_unknown_fields, sampling_of
from .prompt_embeds import payload_prompt_len
from ..structured.gate import GrammarGate
from .emission import Emission
from .state import IdWindow, call_user


RequestBuilder = Callable[[Any], RequestData]
_MESSAGE_TYPES = ("new_request", "stream_chunk", "stream_done")
# Arrivals handled between two checkpoints: a burst never holds the loop for long (228
# arrivals in one go held it 13-14 ms on the H200 host, measured with tools/ticker_lag.py).
_ARRIVALS_PER_CHECKPOINT = 32
# Stream input kept for ids that are neither live nor being admitted (a request that
# may still arrive): bounded, oldest dropped.
_ORPHAN_INPUT_CAP = 1_000


class Intake:
    def __init__(
        self,
        config: SchedulerConfig,
        core: BatchCore,
        door: RequestDoor,
        emission: Emission,
        wake: WakeSignal,
        *,
        request_builder: RequestBuilder | None = None,
        request_build_ready: Callable[[Any, bool], bool] | None = None,
        recheck_on_chunk: Callable[[str, Any], bool] | None = None,
        stream_chunk_handler: Callable[[RequestData, Any], None] | None = None,
        stream_done_handler: Callable[[RequestData], None] | None = None,
    ) -> None:
        """``door`` builds and checks requests; ``emission`` is where every refusal and
        admission goes; ``wake`` is set (from any thread) when a build or a grammar is
        done, so an idle loop takes it."""
        self.config = config
        self.core = core
        self.door = door
        self.emission = emission
        self.request_builder = request_builder  # None: the door's default builder
        self._stream_chunk_handler = stream_chunk_handler
        self._stream_done_handler = stream_done_handler
        self.arrived: deque[IncomingMessage] = deque()
        self._arrived_new: dict[str, int] = {}  # rid -> new_request messages in ``arrived``
        # Ids aborted before they arrived (False) or whose abort was already answered (True).
        self.tombstones: IdWindow[bool] = IdWindow(config.aborted_id_cap, config.aborted_id_keep)
        self.grammars = GrammarGate(door.limits.grammar_compiler, wake.set_threadsafe,
                                    optimistic=optimistic_enabled(config))
        self.admission = Admission(
            config,
            is_ready=_with_grammar(self.grammars, _guarded_ready(request_build_ready) if request_build_ready else None),
            on_build_done=wake.set_threadsafe,
            orphan_cap=_ORPHAN_INPUT_CAP,
            recheck_on_chunk=_guarded_recheck(recheck_on_chunk) if recheck_on_chunk else None,
        )
        emission.end_listeners.append(self.admission.release_input)

    # ------------------------------------------------------------ arrivals

    def put(self, msg: Any) -> None:
        """A message from the inbox (or the thread-safe door), checked at the door."""
        problem = _malformed(msg)
        if problem is not None:
            rid = getattr(msg, "request_id", None)
            log.error("scheduler_malformed_message", error=problem)
            # The sender gets an error where it named an id no live request holds.
            if isinstance(rid, str) and rid and not self.emission.is_live(rid):
                self.emission.reject(rid, errors.InvalidRequestError(problem))
            return
        self.arrived.append(msg)
        if msg.type == "new_request":
            self._arrived_new[msg.request_id] = self._arrived_new.get(msg.request_id, 0) + 1

    def has_arrivals(self) -> bool:
        return bool(self.arrived)

    async def receive_and_admit(self) -> None:
        """Arrivals, re-checked deferrals, builds (inline or collected from the pool)."""
        self._admit_built(self.admission.collect())
        handled = 0
        # Cold (nothing running or waiting), a burst is taken one prefill budget at a
        # time: the first prefill launches after its own requests are admitted, not
        # after the whole burst's (W256 on the H200: the GPU sat idle ~20 ms before).
        cold_budget = self.config.max_prefill_tokens if not self.core.has_work() else None
        while self.arrived:
            msg = self.arrived.popleft()
            rid = msg.request_id
            if msg.type == "new_request":
                self._count_out(rid)
                self._offer(rid, msg.data)
                if cold_budget is not None:
                    cold_budget -= payload_prompt_len(msg.data)
                    if cold_budget <= 0:
                        break
            elif msg.type == "stream_chunk":
                self.on_stream_chunk(rid, msg.data)
            else:
                self.on_stream_done(rid)
            handled += 1
            if handled % _ARRIVALS_PER_CHECKPOINT == 0:
                self.emission.flush()
                await anyio.lowlevel.checkpoint()
        self.admission.dirty.update(self.grammars.take_ready())
        for payload in self.admission.take_dirty():
            self._to_admission(payload)
        inline, rejected = self.admission.stage(self._build)
        for payload in rejected:
            self.emission.reject(payload.request_id, errors.RequestRejectedError(
                f"request-build backlog is full (backlog_limit={self.admission.backlog_limit}); "
                "raise max_queued_requests or request_build_max_pending, or retry later"))
        for i, payload in enumerate(inline):
            try:
                built = [(payload, self._build(payload), None)]
            except Exception as exc:
                built = [(payload, None, exc)]
            self._admit_built(built)
            if (i + 1) % _ARRIVALS_PER_CHECKPOINT == 0:
                self.emission.flush()
                await anyio.lowlevel.checkpoint()
        self._admit_built(self.admission.collect())

    def _count_out(self, rid: str) -> None:
        n = self._arrived_new.get(rid, 0) - 1
        if n > 0:
            self._arrived_new[rid] = n
        else:
            self._arrived_new.pop(rid, None)

    def _offer(self, rid: str, payload: Any) -> None:
        handled = self.tombstones.pop(rid)
        if handled is False:
            self.emission.reject(rid, errors.RequestAbortedError("aborted before admission"))
            return
        if isinstance(payload, dict):
            payload = self._payload_from_dict(rid, payload)
            if payload is None:
                return
        payload_rid = getattr(payload, "request_id", None)
        if payload_rid is None:
            self.emission.reject(rid, errors.InvalidRequestError(
                f"unsupported payload type {type(payload).__name__}: give a RequestPayload or a dict"))
            return
        if payload_rid != rid:
            self.emission.reject(rid, errors.InvalidRequestError(
                f"payload request_id {payload_rid!r} differs from message id {rid!r}"))
            return
        if self.emission.is_live(rid) or rid in self.admission:
            # Not ``reject``: the id belongs to the active request, which keeps it.
            self.emission.send_error(rid, errors.RequestRejectedError(
                f"duplicate request id {rid!r}: a request with this id is active"))
            return
        queued = self.admission.num_queued_unbuilt() + self.core.num_waiting()
        if queued >= self.config.max_queued_requests:
            self.emission.reject(rid, errors.RequestRejectedError(
                f"queue full: {queued} requests queued, max_queued_requests={self.config.max_queued_requests}; "
                "retry later or raise max_queued_requests"))
            return
        # A new request with an ended id leaves the ended window now, not at admission:
        # stream input sent for it while it waits (a deferred build) must be kept.
        self.emission.ended.pop(rid)
        self._to_admission(payload)

    def _to_admission(self, payload: Any) -> None:
        try:
            self.admission.offer(payload)
        except errors.OmniAsyncError as err:  # request_build_ready raised
            self.emission.reject(payload.request_id, err)

    def _payload_from_dict(self, rid: str, raw: dict[str, Any]) -> RequestPayload | None:
        known = {"request_id", "input_ids", "input_embeds", "sampling", "metadata"}
        try:
            refuse_unknown_fields(set(raw) - known)
            return RequestPayload(
                request_id=raw.get("request_id", rid),
                input_ids=raw.get("input_ids") or [],
                input_embeds=raw.get("input_embeds"),
                sampling=sampling_of(raw.get("sampling")),
                metadata=metadata_of(raw.get("metadata")),
            )
        except errors.OmniAsyncError as exc:
            self.emission.reject(rid, exc)
        except Exception as exc:
            self.emission.reject(rid, errors.InvalidRequestError(f"malformed request payload: {exc!r}"))
        return None

    # ------------------------------------------------------------ building and admitting

    def _build(self, payload: Any) -> RequestData:
        """Build one request (on the loop, or on the build pool)."""
        return self.door.build(payload, self.request_builder)

    def _admit_built(self, built: Iterable[tuple[Any, Any, BaseException | None]]) -> None:
        """Validate built requests and enqueue them, in the order given."""
        for payload, data, exc in built:
            rid = payload.request_id
            handled = self.tombstones.get(rid)
            if handled is not None:  # aborted while building
                if not handled:
                    self.tombstones.put(rid, True)
                    self.emission.reject(rid, errors.RequestAbortedError("aborted before admission"))
                continue
            try:
                if exc is not None:
                    raise exc
                if not isinstance(data, RequestData):
                    raise errors.RequestFailedError(f"request builder returned {type(data).__name__}, expected RequestData")
                if data.req.rid != rid:
                    raise errors.InvalidRequestError(f"built request id {data.req.rid!r} differs from message id {rid!r}")
                self.door.fit(data)
                self.grammars.attach(data.req)
            except errors.OmniAsyncError as err:
                self.emission.reject(rid, err)
                continue
            except Exception as err:
                failure = errors.RequestFailedError(f"request builder failed: {err!r}")
                failure.__cause__ = err
                self.emission.reject(rid, failure)
                continue
            data.req.data = data
            self.emission.admit(data)
            try:
                for chunk in getattr(payload, "prefetched_chunks", None) or []:
                    self._append_stream_chunk(data, chunk)
                if getattr(payload, "prefetched_stream_done", False):
                    self._mark_stream_done(data)
                for chunk in self.admission.take_chunks(rid):  # arrived during the build
                    self._append_stream_chunk(data, chunk)
                if self.admission.take_done(rid):
                    self._mark_stream_done(data)
            except errors.OmniAsyncError as err:
                self.emission.fail(rid, err)
                continue
            self.core.add_request(data.req)
            if debug_enabled():
                log.debug("scheduler_queue_enter", request_id=rid)

    def shutdown(self) -> None:
        """Stop the build pool and the grammar compiler's thread (close)."""
        self.admission.shutdown()
        self.grammars.shutdown()

    # ------------------------------------------------------------ stream input

    def on_stream_chunk(self, rid: str, chunk: Any) -> None:
        if rid in self.tombstones or rid in self.emission.ended:
            return
        data = self.emission.live.get(rid)
        if data is None:
            self.admission.on_chunk(rid, chunk)
            return
        try:
            self._append_stream_chunk(data, chunk)
        except errors.OmniAsyncError as err:
            self.emission.fail_request(data.req, err)

    def on_stream_done(self, rid: str) -> None:
        if rid in self.tombstones or rid in self.emission.ended:
            return
        data = self.emission.live.get(rid)
        if data is None:
            self.admission.on_done(rid)
            return
        try:
            self._mark_stream_done(data)
        except errors.OmniAsyncError as err:
            self.emission.fail_request(data.req, err)

    def _append_stream_chunk(self, data: RequestData, chunk: Any) -> None:
        if self._stream_chunk_handler is None:
            data.stream_chunks.append(chunk)
        else:
            call_user("stream chunk handler", self._stream_chunk_handler, data, chunk)

    def _mark_stream_done(self, data: RequestData) -> None:
        if self._stream_done_handler is None:
            data.stream_done = True
        else:
            call_user("stream done handler", self._stream_done_handler, data)

    # ------------------------------------------------------------ aborts and ids

    def remove_arrived(self, rid: str) -> bool:
        """Take an id's messages out of the arrivals (abort). True when a new_request
        for it was among them (its terminal is then the caller's to send)."""
        if rid not in self._arrived_new and not any(m.request_id == rid for m in self.arrived if m.type != "new_request"):
            return False
        found = self._arrived_new.pop(rid, 0) > 0
        self.arrived = deque(m for m in self.arrived if m.request_id != rid)
        return found

    def take_all_arrived_new(self) -> list[str]:
        """Every request id waiting in the arrivals (abort all, close)."""
        rids = [m.request_id for m in self.arrived if m.type == "new_request"]
        self.arrived = deque(m for m in self.arrived if m.type != "new_request")
        self._arrived_new.clear()
        return rids

    def arrived_ids(self) -> set[str]:
        return set(self._arrived_new)

    def add_tombstone(self, rid: str, *, handled: bool) -> None:
        self.tombstones.put(rid, handled)


def _malformed(msg: Any) -> str | None:
    if not isinstance(msg, IncomingMessage):
        return f"inbox messages must be IncomingMessage, got {type(msg).__name__}"
    if not isinstance(msg.request_id, str) or not msg.request_id:
        return f"request_id must be a non-empty str, got {msg.request_id!r}"
    if msg.type not in _MESSAGE_TYPES:
        return f"unknown message type {msg.type!r}; expected one of {', '.join(_MESSAGE_TYPES)}"
    return None


def _guarded_recheck(fn: Callable[[str, Any], bool]) -> Callable[[str, Any], bool]:
    """A raising re-check hook re-checks (the ready check then decides)."""

    def recheck(rid: str, chunk: Any) -> bool:
        try:
            return bool(call_user("recheck_on_chunk", fn, rid, chunk))
        except errors.OmniAsyncError as err:
            log.error("scheduler_recheck_hook_failed", request_id=rid, error=str(err))
            return True

    return recheck


def _with_grammar(gate: GrammarGate, ready: Callable[[Any, bool], bool] | None) -> Callable[[Any, bool], bool]:
    """Ready when the caller's check (if any) says so and the request's grammar compiled
    (the compile starts at the first check, on the gate's thread)."""

    def check(payload: Any, stream_done: bool) -> bool:
        compiled = gate.ready(payload)
        return (ready is None or ready(payload, stream_done)) and compiled

    return check


def _guarded_ready(fn: Callable[[Any, bool], bool]) -> Callable[[Any, bool], bool]:
    def ready(payload: Any, stream_done: bool) -> bool:
        return bool(call_user("request_build_ready", fn, payload, stream_done))

    return ready
