"""AsyncOmniScheduler: the stage-facing asyncio scheduler.

Channels are anyio memory object streams: ``inbox`` (send :class:`IncomingMessage`),
``outbox`` (receive :class:`OutgoingMessage`) and an admin channel. One of the loops in
:mod:`omni_async.loops` drives the batch core and the runner; this class holds what the
loops share: admission, stream input, emission, aborts, failures, admin, and shutdown.

Invariants: every request that entered ``inbox`` gets exactly one terminal message
(``result`` or ``error``); KV is freed exactly once, by the batch core.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import math
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable

import anyio
import anyio.abc
import torch

from . import errors
from .config import SamplingParams, SchedulerConfig
from .core.batch import ScheduledBatch
from .core.batch_core import BatchCore
from .core.request import Request, RequestData
from .admission import Admission
from .channels import drain_stream
from .device import ThreadStepExecutor
from .logs import debug_enabled, log
from .messages import (
    GenerationResult,
    IncomingMessage,
    OutgoingMessage,
    RequestPayload,
    StreamDelta,
)
from .runners.base import ModelRunner
from .runners.types import ModelRunnerOutput, RequestOutput, SchedulerOutput, SchedulerRequest

RequestBuilder = Callable[[Any], RequestData]
ResultAdapter = Callable[[RequestData], Any]
StreamOutputBuilder = Callable[[str, RequestData, RequestOutput], Iterable[OutgoingMessage]]


@dataclass(frozen=True)
class ModelLimits:
    """What admission checks requests against."""

    vocab_size: int
    context_length: int
    kv_capacity_tokens: int
    eos_token_ids: tuple[int, ...] = ()


@dataclass
class _AdminRequest:
    action: str
    payload: dict[str, Any]
    reply: "asyncio.Future[dict[str, Any]]"


@dataclass
class InflightStep:
    """A step handed to the device whose result the host has not processed yet."""

    batch: ScheduledBatch
    sched_output: SchedulerOutput
    future: "concurrent.futures.Future[Any] | None"  # None when the launch itself failed
    lookahead: bool = False  # launched with runner.launch(lookahead=True)
    error: BaseException | None = None


@dataclass
class SchedulerStats:
    iterations: int = 0
    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    tokens_out: int = 0
    failed_steps: int = 0
    trace: list[str] = field(default_factory=list)  # filled only when trace_enabled


class AsyncOmniScheduler:
    def __init__(
        self,
        runner: ModelRunner,
        core: BatchCore,
        limits: ModelLimits,
        *,
        config: SchedulerConfig | None = None,
        executor: ThreadStepExecutor | None = None,
        request_builder: RequestBuilder | None = None,
        result_adapter: ResultAdapter | None = None,
        stream_output_builder: StreamOutputBuilder | None = None,
        stream_chunk_handler: Callable[[RequestData, Any], None] | None = None,
        stream_done_handler: Callable[[RequestData], None] | None = None,
        abort_callback: Callable[[str], None] | None = None,
        request_build_ready: Callable[[Any, bool], bool] | None = None,
        model_info: dict[str, Any] | None = None,
        model_worker: Any = None,
    ) -> None:
        self.config = config or SchedulerConfig()
        self.runner = runner
        self.core = core
        self.limits = limits
        self.executor = executor or ThreadStepExecutor()
        self._request_builder = request_builder or self.default_request_builder
        self._result_adapter = result_adapter or default_result_adapter
        self._stream_output_builder = stream_output_builder or default_stream_output_builder
        self._stream_chunk_handler = stream_chunk_handler
        self._stream_done_handler = stream_done_handler
        self._abort_callback = abort_callback
        self._model_info = dict(model_info or {})
        self.model_worker = model_worker
        self.weight_version: str | None = self._model_info.get("weight_version")

        self.inbox, self._inbox_rx = anyio.create_memory_object_stream[IncomingMessage](math.inf)
        self._outbox_tx, self.outbox = anyio.create_memory_object_stream[OutgoingMessage](math.inf)
        self._admin_tx, self._admin_rx = anyio.create_memory_object_stream[_AdminRequest](math.inf)

        self._arrived: deque[IncomingMessage] = deque()
        self._live: dict[str, RequestData] = {}
        self._tombstones: OrderedDict[str, bool] = OrderedDict()  # rid -> abort already handled
        self._ended: OrderedDict[str, None] = OrderedDict()  # recently terminated ids
        self.admission = Admission(
            self.config,
            build=self._run_request_builder,
            is_ready=request_build_ready,
            on_build_done=lambda: self._call_in_loop(self.wake),
        )
        self._first_emit_done: set[str] = set()
        self._prefill_start_done: set[str] = set()
        self._wake = asyncio.Event()
        self._stopped = anyio.Event()
        self._state = "new"  # new -> running -> closing -> closed
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._task_group: Any = None  # run()'s own group: the pump and background admin
        self._outer_group: Any = None  # the group ``async with`` runs run() in
        self._background_scopes: set[anyio.CancelScope] = set()
        self.paused = False
        self.pause_mode: str | None = None
        self.stats = SchedulerStats()
        self.trace_enabled = False
        # Set by a loop that can hold a step in flight across iterations.
        self.drain_hook: Callable[[], Awaitable[None]] | None = None

    # ================================================================ lifecycle

    @property
    def serving(self) -> bool:
        return self._state == "running"

    @property
    def closed(self) -> bool:
        return self._state in ("closing", "closed")

    async def __aenter__(self) -> "AsyncOmniScheduler":
        self._outer_group = anyio.create_task_group()
        await self._outer_group.__aenter__()
        await self._outer_group.start(self.run)
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        try:
            await self.aclose()
        finally:
            tg, self._outer_group = self._outer_group, None
            if tg is not None:
                await tg.__aexit__(*exc_info)
        return None

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until closed. Run it in a task group you own (``await tg.start(s.run)``
        returns once it serves), or use ``async with``."""
        from .loops import LOOPS

        if self._state in ("closing", "closed"):
            task_status.started()
            return  # closed before the loop started: nothing to serve
        if self._state != "new":
            raise RuntimeError(f"scheduler cannot run from state {self._state!r}")
        self._state = "running"
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        task_status.started()
        try:
            async with anyio.create_task_group() as tg:
                self._task_group = tg
                tg.start_soon(self._pump_inbox)
                try:
                    await LOOPS[self.config.loop](self)
                finally:
                    for scope in list(self._background_scopes):
                        scope.cancel()
                    self.inbox.close()  # the pump ends once the buffer is drained
        finally:
            with anyio.CancelScope(shield=True):
                await self._shutdown()

    async def aclose(self) -> None:
        """Stop serving: the step in flight completes, then every open request ends with
        one ``error`` (SchedulerClosedError); the worker thread stops."""
        if self._state == "new":
            self._state = "closing"
            with anyio.CancelScope(shield=True):
                await self._shutdown()
            return
        if self._state == "running":
            self._state = "closing"
            self.wake()
        await self._stopped.wait()

    async def _shutdown(self) -> None:
        self._state = "closing"
        while True:
            try:
                self._arrived.append(self._inbox_rx.receive_nowait())
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                break
        await self.executor.aclose()
        closed = errors.SchedulerClosedError("aborted: scheduler closed")
        for msg in self._arrived:
            if msg.type == "new_request" and msg.request_id not in self._live:
                self._send(OutgoingMessage(msg.request_id, "error", closed))
        self._arrived.clear()
        for payload in self.admission.drain_all():
            self._send(OutgoingMessage(payload.request_id, "error", closed))
        self.admission.shutdown()
        for req in self.core.abort_all():
            self._terminate_error(req.rid, errors.SchedulerClosedError("aborted: scheduler closed", output_ids=req.output_ids))
        for rid in list(self._live):
            self._terminate_error(rid, errors.SchedulerClosedError("aborted: scheduler closed"))
        while True:
            try:
                admin = self._admin_rx.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                break
            if not admin.reply.done():
                admin.reply.set_result(_admin_failure("scheduler closed"))
        self.inbox.close()
        self._admin_tx.close()
        self._outbox_tx.close()
        self._state = "closed"
        self._stopped.set()

    async def _pump_inbox(self) -> None:
        async for msg in drain_stream(self._inbox_rx):
            self._arrived.append(msg)
            self._wake.set()

    # ================================================================ waking

    def wake(self) -> None:
        self._wake.set()

    def _call_in_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        loop = self._loop
        if loop is None or threading.get_ident() == self._loop_thread:
            fn(*args)
        else:
            loop.call_soon_threadsafe(fn, *args)

    async def wait_for_work(self) -> None:
        """Idle: await the channels (no polling). Anything that may create work sets the
        wake event: arrivals, aborts, admin requests, build completions, close."""
        if self.serving:
            await self._wake.wait()

    # ================================================================ the thread-safe door

    def submit_threadsafe(self, msg: IncomingMessage) -> None:
        """Put a message in the inbox from a thread that is not the loop's."""
        if self.closed:
            raise errors.SchedulerClosedError("scheduler is closed")
        self._call_in_loop(self.inbox.send_nowait, msg)

    def abort_threadsafe(self, request_id: str) -> None:
        self._call_in_loop(self.abort, request_id)

    # ================================================================ one iteration

    async def begin_iteration(self) -> None:
        """Admin, receive, admission, and aborted-request reaping: the head of every
        loop iteration, in the reference's order."""
        self._wake.clear()
        self.stats.iterations += 1
        await self.serve_admin()
        self._receive_and_admit()
        for req in self.core.reap_aborted():
            self._finish_request(req)

    def _receive_and_admit(self) -> None:
        """Arrivals, re-checked deferrals, builds (inline or collected from the pool)."""
        self._admit_built(self.admission.collect())
        while self._arrived:
            msg = self._arrived.popleft()
            if msg.type == "new_request":
                self._offer(msg.request_id, msg.data)
            elif msg.type == "stream_chunk":
                self._on_stream_chunk(msg.request_id, msg.data)
            elif msg.type == "stream_done":
                self._on_stream_done(msg.request_id)
            else:
                self._send(
                    OutgoingMessage(
                        msg.request_id,
                        "error",
                        errors.InvalidRequestError(f"unknown message type {msg.type!r}"),
                    )
                )
        for payload in self.admission.take_dirty():
            self.admission.offer(payload)
        inline, rejected = self.admission.stage()
        for payload in rejected:
            self._send(
                OutgoingMessage(
                    payload.request_id,
                    "error",
                    errors.RequestRejectedError(
                        f"request-build backlog is full (backlog_limit={self.admission.backlog_limit}); "
                        "raise max_queued_requests or request_build_max_pending, or retry later"
                    ),
                )
            )
        for payload in inline:
            try:
                self._admit_built([(payload, self._run_request_builder(payload), None)])
            except Exception as exc:
                self._admit_built([(payload, None, exc)])
        self._admit_built(self.admission.collect())

    def _offer(self, rid: str, payload: Any) -> None:
        if rid in self._tombstones:
            handled = self._tombstones.pop(rid)
            if not handled:
                self._send(OutgoingMessage(rid, "error", errors.RequestAbortedError("aborted before admission")))
                return
        payload_rid = payload.get("request_id", rid) if isinstance(payload, dict) else getattr(payload, "request_id", rid)
        if payload_rid != rid:
            self._send(OutgoingMessage(rid, "error", errors.InvalidRequestError(
                f"payload request_id {payload_rid!r} differs from message id {rid!r}")))
            return
        if rid in self._live or rid in self.admission:
            self._send(
                OutgoingMessage(rid, "error", errors.RequestRejectedError(f"duplicate request id {rid!r}: a request with this id is active"))
            )
            return
        # Builds and their backlog have their own bound (the backlog limit); this one is
        # the waiting queue, as in the reference.
        queued = self.admission.num_queued_unbuilt() + self.core.stats()["waiting_queue_size"]
        if queued >= self.config.max_queued_requests:
            self._send(
                OutgoingMessage(rid, "error", errors.RequestRejectedError(
                    f"queue full: {queued} requests queued, max_queued_requests={self.config.max_queued_requests}; "
                    "retry later or raise max_queued_requests"))
            )
            return
        if isinstance(payload, dict):
            payload = self._payload_from_dict(rid, payload)
            if payload is None:
                return
        if not hasattr(payload, "request_id"):
            self._send(OutgoingMessage(rid, "error", errors.InvalidRequestError(
                f"unsupported payload type {type(payload).__name__}: give a RequestPayload")))
            return
        self.admission.offer(payload)

    def _payload_from_dict(self, rid: str, raw: dict[str, Any]) -> RequestPayload | None:
        known = {"request_id", "input_ids", "sampling", "metadata"}
        try:
            unknown = sorted(set(raw) - known)
            if unknown:
                raise errors.InvalidRequestError(f"unknown request field(s): {', '.join(unknown)}")
            sampling = raw.get("sampling")
            if sampling is not None and not isinstance(sampling, (SamplingParams, dict)):
                raise errors.InvalidRequestError(f"sampling must be SamplingParams or a dict, got {type(sampling).__name__}")
            return RequestPayload(
                request_id=raw.get("request_id", rid),
                input_ids=raw.get("input_ids") or [],
                sampling=sampling if isinstance(sampling, SamplingParams) else SamplingParams.from_dict(sampling),
                metadata=dict(raw.get("metadata") or {}),
            )
        except errors.OmniAsyncError as exc:
            self._send(OutgoingMessage(rid, "error", exc))
        except Exception as exc:
            self._send(OutgoingMessage(rid, "error", errors.InvalidRequestError(f"malformed request payload: {exc!r}")))
        return None

    def _run_request_builder(self, payload: Any) -> RequestData:
        rid = payload.request_id
        log.debug("scheduler_request_build_start", request_id=rid)
        data = self._request_builder(payload)
        log.debug("scheduler_request_build_end", request_id=rid)
        return data

    def _admit_built(self, built: list[tuple[Any, Any, BaseException | None]]) -> None:
        """Validate built requests and enqueue them, in the order given."""
        for payload, data, exc in built:
            rid = payload.request_id
            if rid in self._tombstones:
                continue  # aborted while building; its terminal was sent by abort()
            try:
                if exc is not None:
                    raise exc
                if not isinstance(data, RequestData):
                    raise TypeError(f"request_builder returned {type(data).__name__}, expected RequestData")
                if data.req.rid != rid:
                    raise errors.InvalidRequestError(f"built request id {data.req.rid!r} differs from message id {rid!r}")
                if data.enforce_request_limits:
                    self.check_limits(data.req)
            except errors.OmniAsyncError as err:
                self._send(OutgoingMessage(rid, "error", err))
                continue
            except Exception as err:  # a user builder raised
                failure = errors.RequestFailedError(f"request builder failed: {err!r}")
                failure.__cause__ = err
                self._send(OutgoingMessage(rid, "error", failure))
                continue
            data.req.data = data
            self._live[rid] = data
            for chunk in getattr(payload, "prefetched_chunks", None) or []:
                self._append_stream_chunk(data, chunk)
            if getattr(payload, "prefetched_stream_done", False):
                self._mark_stream_done(data)
            for chunk in self.admission.chunks.pop(rid, []):  # arrived during the build
                self._append_stream_chunk(data, chunk)
            if rid in self.admission.done:
                self.admission.done.discard(rid)
                self._mark_stream_done(data)
            self.core.add_request(data.req)
            log.debug("scheduler_queue_enter", request_id=rid)

    def check_limits(self, req: Request) -> None:
        """Refuse what can never be served: say which limit and by how much."""
        n_in = len(req.prompt_ids)
        n_new = req.sampling.max_new_tokens
        ctx = self.limits.context_length
        if n_in + n_new > ctx:
            raise errors.RequestRejectedError(
                f"request needs {n_in + n_new} tokens (input {n_in} + max_new_tokens {n_new}), "
                f"over the context length {ctx} by {n_in + n_new - ctx}; shorten the input or lower max_new_tokens"
            )
        cap = self.limits.kv_capacity_tokens
        if n_in + n_new > cap:
            raise errors.RequestRejectedError(
                f"request needs {n_in + n_new} tokens of KV (input {n_in} + max_new_tokens {n_new}), "
                f"over the KV cache capacity {cap} by {n_in + n_new - cap}; raise kv_capacity_tokens "
                "(or kv_memory_fraction on CUDA) or lower max_new_tokens"
            )

    def default_request_builder(self, payload: Any) -> RequestData:
        """Build from a :class:`RequestPayload` (dicts are converted on arrival)."""
        if not isinstance(payload, RequestPayload):
            raise errors.InvalidRequestError(f"unsupported payload type {type(payload).__name__}")
        ids = validate_input_ids(payload.input_ids, self.limits.vocab_size)
        sampling = payload.sampling
        if not isinstance(sampling, SamplingParams):
            raise errors.InvalidRequestError("sampling must be a SamplingParams")
        sampling.validate()
        check_sampling_against_vocab(sampling, self.limits.vocab_size)
        req = Request(
            rid=payload.request_id,
            prompt_ids=ids,
            sampling=sampling,
            eos_token_ids=self.limits.eos_token_ids,
        )
        return RequestData(req=req, payload=payload)

    # ================================================================ stream input

    def _on_stream_chunk(self, rid: str, chunk: Any) -> None:
        if rid in self._tombstones or rid in self._ended:
            return
        data = self._live.get(rid)
        if data is not None:
            self._append_stream_chunk(data, chunk)
        else:
            self.admission.on_chunk(rid, chunk)

    def _on_stream_done(self, rid: str) -> None:
        if rid in self._tombstones or rid in self._ended:
            return
        data = self._live.get(rid)
        if data is not None:
            self._mark_stream_done(data)
        else:
            self.admission.on_done(rid)

    def _append_stream_chunk(self, data: RequestData, chunk: Any) -> None:
        if self._stream_chunk_handler is None:
            data.stream_chunks.append(chunk)
        else:
            self._stream_chunk_handler(data, chunk)

    def _mark_stream_done(self, data: RequestData) -> None:
        if self._stream_done_handler is None:
            data.stream_done = True
        else:
            self._stream_done_handler(data)

    # ================================================================ steps

    def build_sched_output(self, batch: ScheduledBatch) -> SchedulerOutput:
        if debug_enabled():
            for req in batch.reqs:
                if req.rid not in self._prefill_start_done:
                    self._prefill_start_done.add(req.rid)
                    log.debug("scheduler_prefill_start", request_id=req.rid, mode=batch.mode.value)
        self.stats.steps += 1
        if batch.is_decode:
            self.stats.decode_steps += 1
        else:
            self.stats.prefill_steps += 1
        return SchedulerOutput(
            requests=[SchedulerRequest(request_id=r.rid, data=r.data) for r in batch.reqs],
            batch_data=batch,
        )

    async def run_batch(self, batch: ScheduledBatch) -> None:
        """One synchronous step: launch, await, process (a failure is handled here)."""
        await self.finish_step(self.launch_step(batch, trace="sync"))

    def launch_step(self, batch: ScheduledBatch, *, lookahead: bool = False, trace: str = "launch") -> InflightStep:
        """Queue a step's launch on the worker without waiting for it: the whole step
        (``runner.launch``), or a lookahead decode step (``runner.launch(lookahead=True)``)."""
        sched_output = self.build_sched_output(batch)
        self.trace(trace, batch)
        try:
            fut = self.executor.launch(functools.partial(self.runner.launch, lookahead=lookahead), sched_output)
        except Exception as exc:
            return InflightStep(batch, sched_output, None, lookahead, exc)
        return InflightStep(batch, sched_output, fut, lookahead)

    async def finish_step(self, step: InflightStep) -> None:
        """Await a launched step (its launch, then its device completion), take its
        output (``runner.collect``), process it."""
        try:
            if step.future is None:
                raise step.error or RuntimeError("step was not launched")
            pending = await self.executor.wait(step.future)
            if pending is not None:
                await self.executor.completion(pending.event)
            out = self.runner.collect(pending) if pending is not None else None
            if out is None:
                raise RuntimeError("runner produced no output for a non-empty batch")
        except Exception as exc:
            self.handle_batch_failure(step.batch, exc)
            return
        self.process_batch_result(step.batch, out)

    def process_batch_result(self, batch: ScheduledBatch, out: ModelRunnerOutput) -> None:
        outcomes = self.core.process_result(batch, out.token_ids, out.logprobs)
        for oc in outcomes:
            req = oc.req
            data: RequestData = req.data
            if oc.token is not None:
                self.stats.tokens_out += 1
                if oc.logprob is not None and req.sampling.return_logprob:
                    data.output_token_logprobs.append([oc.logprob, oc.token])
                req_output = out.outputs.get(req.rid) or RequestOutput(req.rid, oc.token)
                req_output.finished = oc.finished
                if not self._emit_stream(req, req_output):
                    continue
            if oc.finished:
                self._finish_request(req)

    def handle_batch_failure(self, batch: ScheduledBatch, exc: BaseException) -> None:
        """A step raised: every live request in it ends with an error, KV released;
        the loop carries on with the others."""
        self.stats.failed_steps += 1
        rids = [r.rid for r in batch.reqs]
        log.error("scheduler_batch_failed", request_ids=rids, error=repr(exc))
        live = [batch.reqs[i] for i in range(batch.size) if batch.row_is_live(i)]
        for req in self.core.fail_requests(live):
            err = errors.RequestFailedError(f"model step failed: {exc!r}")
            err.__cause__ = exc
            self._terminate_error(req.rid, err)

    def _emit_stream(self, req: Request, req_output: RequestOutput) -> bool:
        rid = req.rid
        try:
            msgs = list(self._stream_output_builder(rid, req.data, req_output))
        except Exception as exc:
            err = errors.RequestFailedError(f"stream output builder failed: {exc!r}")
            err.__cause__ = exc
            self._fail_request(req, err)
            return False
        if msgs and rid not in self._first_emit_done:
            self._first_emit_done.add(rid)
            log.debug("scheduler_first_emit", request_id=rid)
        for msg in msgs:
            self._send(msg)
        return True

    def _fail_request(self, req: Request, err: Exception) -> None:
        self.core.fail_requests([req])  # releases KV unless the request already finished
        self._terminate_error(req.rid, err)

    def _finish_request(self, req: Request) -> None:
        rid = req.rid
        data: RequestData | None = self._live.get(rid)
        if data is None:
            return
        log.debug("scheduler_finish", request_id=rid, finish_reason=req.finish_reason, output_tokens=len(req.output_ids))
        if req.finish_reason == "abort":
            self._terminate_error(rid, errors.RequestAbortedError("request aborted", output_ids=req.output_ids))
            return
        data.output_ids = list(req.output_ids)
        data.finish_reason = req.finish_reason
        data.weight_version = self.weight_version
        try:
            result = self._result_adapter(data)
        except Exception as exc:
            err = errors.RequestFailedError(f"result adapter failed: {exc!r}")
            err.__cause__ = exc
            self._terminate_error(rid, err)
            return
        self._live.pop(rid, None)
        self._forget(rid)
        self._send(OutgoingMessage(rid, "result", result))

    def _terminate_error(self, rid: str, err: Exception) -> None:
        if self._live.pop(rid, None) is None:
            return
        self._forget(rid)
        self._send(OutgoingMessage(rid, "error", err))

    def _forget(self, rid: str) -> None:
        self._ended[rid] = None
        self._ended.move_to_end(rid)
        _trim(self._ended, self.config.aborted_id_cap, self.config.aborted_id_keep)
        self._first_emit_done.discard(rid)
        self._prefill_start_done.discard(rid)

    def _send(self, msg: OutgoingMessage) -> None:
        try:
            self._outbox_tx.send_nowait(msg)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass  # nobody listens any more

    def trace(self, what: str, batch: ScheduledBatch | None) -> None:
        if self.trace_enabled:
            self.stats.trace.append(f"{what}:{batch.size if batch is not None else 0}")

    # ================================================================ aborts

    def abort(self, request_id: str) -> None:
        """Abort wherever the request is. A request not yet admitted or waiting ends now;
        a running one ends at the next step boundary. Exactly one terminal message."""
        rid = request_id
        found = False
        for msg in list(self._arrived):
            if msg.request_id == rid:
                self._arrived.remove(msg)
                if msg.type == "new_request" and rid not in self._live:
                    found = True
                    self._send(OutgoingMessage(rid, "error", errors.RequestAbortedError("aborted before admission")))
        if self.admission.remove(rid):
            found = True
            self._send(OutgoingMessage(rid, "error", errors.RequestAbortedError("aborted before admission")))
        req = self.core.abort(rid)
        if req is not None:
            found = True
            self._finish_request(req)
        elif rid in self._live:
            found = True  # running: marked, reaped at the next boundary
        # An id found nowhere either ended already or has not arrived yet: only the
        # latter must be refused when it arrives.
        self._add_tombstone(rid, handled=found or rid in self._ended)
        if self._abort_callback is not None:
            try:
                self._abort_callback(rid)
            except Exception as exc:
                log.error("scheduler_abort_callback_failed", request_id=rid, error=repr(exc))
        self.wake()

    def _add_tombstone(self, rid: str, *, handled: bool) -> None:
        self._tombstones[rid] = handled
        self._tombstones.move_to_end(rid)
        _trim(self._tombstones, self.config.aborted_id_cap, self.config.aborted_id_keep)

    # ================================================================ admin

    async def admin(self, action: str, payload: dict[str, Any] | None = None) -> dict[str, Any]:
        """Run an admin action at the top of a loop iteration (also while paused)."""
        payload = dict(payload or {})
        if not self.serving:
            if self.closed:
                return _admin_failure("scheduler closed")
            return await self._run_admin(action, payload)
        reply: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._admin_tx.send_nowait(_AdminRequest(action, payload, reply))
        self.wake()
        return await reply

    def admin_threadsafe(self, action: str, payload: dict[str, Any] | None = None, timeout: float | None = None) -> dict[str, Any]:
        """The admin door for other threads: waits up to ``timeout`` (default from
        config, 300 s) and answers with a failure when it expires."""
        payload = dict(payload or {})
        timeout = float(payload.pop("_admin_timeout_s", timeout if timeout is not None else self.config.admin_timeout_s))
        loop = self._loop
        if loop is None or not self.serving:
            return _admin_failure("scheduler is not serving")
        fut = asyncio.run_coroutine_threadsafe(self.admin(action, payload), loop)
        try:
            return fut.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            return _admin_failure(f"admin operation timed out after {timeout:.1f}s", error="admin operation timed out")

    async def serve_admin(self) -> None:
        while True:
            try:
                item = self._admin_rx.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                return
            if item.reply.done():
                continue
            from .admin import BACKGROUND_ACTIONS

            if item.action in BACKGROUND_ACTIONS and self._task_group is not None:
                self._task_group.start_soon(self._serve_admin_in_background, item)
            else:
                await self._serve_admin_item(item)

    async def _serve_admin_in_background(self, item: _AdminRequest) -> None:
        with anyio.CancelScope() as scope:
            self._background_scopes.add(scope)
            try:
                await self._serve_admin_item(item)
            finally:
                self._background_scopes.discard(scope)
                if not item.reply.done():
                    item.reply.set_result(_admin_failure("scheduler closed"))

    async def _serve_admin_item(self, item: _AdminRequest) -> None:
        try:
            reply = await self._run_admin(item.action, item.payload)
        except Exception as exc:
            log.error("scheduler_admin_failed", action=item.action, error=repr(exc))
            reply = _admin_failure(str(exc))
        if not item.reply.done():
            item.reply.set_result(reply)

    async def _run_admin(self, action: str, payload: dict[str, Any]) -> dict[str, Any]:
        from .admin import run_admin_action

        return await run_admin_action(self, action, payload)

    async def drain_inflight(self) -> None:
        """Finish and process any step still in flight (the lookahead loops set a
        drain; the normal loop has nothing in flight between iterations)."""
        if self.drain_hook is not None:
            await self.drain_hook()

    def abort_all_active(self, reason: str) -> int:
        """End every active request now (arrived and admission included), each with one
        aborted error."""
        arrived = [m for m in self._arrived if m.type == "new_request" and m.request_id not in self._live]
        self._arrived = deque(m for m in self._arrived if m.type != "new_request" or m.request_id in self._live)
        for msg in arrived:
            self._send(OutgoingMessage(msg.request_id, "error", errors.RequestAbortedError(reason)))
        payloads = self.admission.drain_all()
        for payload in payloads:
            self._send(OutgoingMessage(payload.request_id, "error", errors.RequestAbortedError(reason)))
        victims = self.core.abort_all()
        for req in victims:
            self._terminate_error(req.rid, errors.RequestAbortedError(reason, output_ids=req.output_ids))
        return len(victims) + len(payloads) + len(arrived)

    def admission_stats(self) -> dict[str, Any]:
        return self.admission.stats()

    # ================================================================ introspection

    def active_request_ids(self) -> list[str]:
        """Requests arrived, being admitted, or admitted, and not yet terminated."""
        arrived = {m.request_id for m in self._arrived if m.type == "new_request"}
        return sorted(set(self._live) | set(self.admission.active_ids()) | arrived)



def _trim(d: OrderedDict, cap: int, keep: int) -> None:
    """Bounded bookkeeping: past ``cap`` entries, keep only the newest ``keep``."""
    if len(d) > cap:
        while len(d) > keep:
            d.popitem(last=False)


def _admin_failure(message: str, *, error: str | None = None) -> dict[str, Any]:
    return {"success": False, "message": message, "data": {}, "error": error or message}


def validate_input_ids(input_ids: Any, vocab_size: int) -> list[int]:
    if isinstance(input_ids, torch.Tensor):
        input_ids = input_ids.flatten().tolist()
    if not isinstance(input_ids, (list, tuple)):
        raise errors.InvalidRequestError(f"input_ids must be a list of ints, got {type(input_ids).__name__}")
    if len(input_ids) == 0:
        raise errors.InvalidRequestError("empty prompt: input_ids has no tokens")
    out = []
    for i, t in enumerate(input_ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise errors.InvalidRequestError(f"input_ids[{i}] is {t!r}, not an int")
        if not 0 <= t < vocab_size:
            raise errors.InvalidRequestError(
                f"input_ids[{i}] = {t} is outside the vocabulary [0, {vocab_size})"
            )
        out.append(int(t))
    return out


def check_sampling_against_vocab(sampling: SamplingParams, vocab_size: int) -> None:
    for name in ("suppress_tokens", "stop_token_ids"):
        bad = [t for t in getattr(sampling, name) if t >= vocab_size]
        if bad:
            raise errors.InvalidRequestError(f"{name} {bad} outside the vocabulary [0, {vocab_size})")
    if len(set(sampling.suppress_tokens)) >= vocab_size:
        raise errors.InvalidRequestError("suppress_tokens covers the whole vocabulary: nothing could be sampled")


def default_result_adapter(data: RequestData) -> GenerationResult:
    req = data.req
    return GenerationResult(
        request_id=req.rid,
        output_ids=list(data.output_ids),
        finish_reason=data.finish_reason,
        prompt_ids=list(req.prompt_ids),
        output_logprobs=[lp for lp, _ in data.output_token_logprobs] if req.sampling.return_logprob else None,
        weight_version=data.weight_version,
        extra={k: v for k, v in data.extra_model_outputs.items() if k != "hidden_state"},
    )


def default_stream_output_builder(rid: str, data: RequestData, out: RequestOutput) -> list[OutgoingMessage]:
    if out.data is None:
        return []
    req = data.req
    delta = StreamDelta(
        request_id=rid,
        token_ids=[int(out.data)],
        logprobs=[out.logprob] if (req.sampling.return_logprob and out.logprob is not None) else None,
        finished=out.finished,
        finish_reason=req.finish_reason if out.finished else None,
        extra=dict(out.extra),
    )
    return [OutgoingMessage(rid, "stream", delta)]
