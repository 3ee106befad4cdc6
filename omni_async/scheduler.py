"""AsyncOmniScheduler: the stage-facing scheduler, as coroutines.

This module holds the stage's lifecycle and channels, the thread-safe door and the head
of every loop iteration; the work is split by concern under :mod:`omni_async.stage`:
``intake`` (arrivals, admission, stream input, tombstones), ``request_checks`` (the door
a request is checked at, once), ``emission`` (the live table and exactly one terminal
message per request), ``stepper`` (the one step path the loops drive) and ``control``
(pause, resume, drain, abort_all, info; admin actions are written against it).

The parts are wired by construction: each gets the collaborators it uses (the intake
the emission it refuses through, control the objects it controls, the stepper the
wake signal it idles on); none holds the scheduler or calls back up into it.

Channels are anyio memory object streams: ``inbox`` (send :class:`IncomingMessage`),
``outbox`` (receive :class:`OutgoingMessage`) and an admin channel.
"""

from __future__ import annotations

import math
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

import anyio
import anyio.abc
import anyio.lowlevel

from . import errors
from .stage.admin import AdminRequest, failure
from .stage.admin_channel import AdminChannel
from .stage.channels import OutboxSink, WakeSignal, drain_stream, take_buffered
from .config import SchedulerConfig
from .core.plan import settle
from .core.protocol import BatchCore, StepRunner
from .core.request import RequestData
from .stage.executor import StepExecutor, ThreadStepExecutor, await_future
from .logs import log
from .loops import LOOPS
from .messages import IncomingMessage, OutgoingMessage
from .stage.control import StageControl
from .stage.emission import ColumnsSink, Emission, OutputSink, ResultAdapter, StreamOutputBuilder
from .stage.intake import Intake, RequestBuilder
from .stage.state import StageState
from .stage.request_checks import ModelLimits, RequestDoor
from .stage.stepper import Stepper, StepStats

__all__ = ["AsyncOmniScheduler", "ModelLimits"]


class AsyncOmniScheduler:
    def __init__(
        self,
        runner: StepRunner,
        core: BatchCore,
        limits: ModelLimits,
        *,
        config: SchedulerConfig | None = None,
        executor: StepExecutor | None = None,
        request_builder: RequestBuilder | None = None,
        result_adapter: ResultAdapter | None = None,
        stream_output_builder: StreamOutputBuilder | None = None,
        stream_chunk_handler: Callable[[RequestData, Any], None] | None = None,
        stream_done_handler: Callable[[RequestData], None] | None = None,
        abort_callback: Callable[[str], None] | None = None,
        request_build_ready: Callable[[Any, bool], bool] | None = None,
        recheck_on_chunk: Callable[[str, Any], bool] | None = None,
        model_info: dict[str, Any] | None = None,
        model_worker: Any = None,
        output_sink: OutputSink | None = None,
    ) -> None:
        # A stage assembled by hand (no builder's plan) gets the CPU prefill budget.
        self.config = settle(config or SchedulerConfig())
        self.runner = runner
        self.core = core
        self.executor = executor or ThreadStepExecutor()
        self._abort_callback = abort_callback

        self.inbox, self._inbox_rx = anyio.create_memory_object_stream[IncomingMessage](math.inf)
        self._outbox_tx, self.outbox = anyio.create_memory_object_stream[OutgoingMessage](math.inf)

        self._wake = WakeSignal()
        self._stopped = anyio.Event()
        self.state = StageState(weight_version=(model_info or {}).get("weight_version"))
        self._background: anyio.abc.TaskGroup | None = None

        self.stats = StepStats()
        self.door = RequestDoor(limits)
        self.emission = Emission(
            core,
            output_sink or OutboxSink(self._outbox_tx),
            result_adapter=result_adapter,
            stream_output_builder=stream_output_builder,
            state=self.state,
            ended_cap=self.config.aborted_id_cap,
            ended_keep=self.config.aborted_id_keep,
            stats=self.stats,
            stream_interval=self.config.stream_interval,
        )
        self.intake = Intake(
            self.config,
            core,
            self.door,
            self.emission,
            self._wake,
            request_builder=request_builder,
            request_build_ready=request_build_ready,
            recheck_on_chunk=recheck_on_chunk,
            stream_chunk_handler=stream_chunk_handler,
            stream_done_handler=stream_done_handler,
        )
        self.stepper = Stepper(core, runner, self.executor, self.emission, wake=self._wake, state=self.state, config=self.config, stats=self.stats)
        self.control = StageControl(
            core,
            self.intake,
            self.emission,
            self.stepper,
            runner,
            self.executor,
            wake=self._wake,
            state=self.state,
            loop_name=self.config.loop,
            model_info=model_info,
            model_worker=model_worker,
        )
        self.admin_channel = AdminChannel(self.control)

    # ================================================================ lifecycle

    @property
    def serving(self) -> bool:
        return self.state.serving

    @property
    def closed(self) -> bool:
        return self.state.closed

    @property
    def trace_enabled(self) -> bool:
        return self.stepper.tracing

    @trace_enabled.setter
    def trace_enabled(self, value: bool) -> None:
        self.stepper.tracing = bool(value)

    async def __aenter__(self) -> "AsyncOmniScheduler":
        self._serving_cm = self.serving_context()
        return await self._serving_cm.__aenter__()

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        return await self._serving_cm.__aexit__(*exc_info)

    @asynccontextmanager
    async def serving_context(self) -> AsyncIterator["AsyncOmniScheduler"]:
        """Serve inside the block, in a task group the block owns; close at its end."""
        async with anyio.create_task_group() as tg:
            await tg.start(self.run)
            try:
                yield self
            finally:
                with anyio.CancelScope(shield=True):
                    await self.aclose()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until closed. Run it in a task group you own (``await tg.start(s.run)``
        returns once it serves), or use ``async with``."""
        if self.closed:
            task_status.started()
            return  # closed before the loop started: nothing to serve
        if self.state.lifecycle != "new":
            raise RuntimeError(f"scheduler cannot run from state {self.state.lifecycle!r}")
        self.state.lifecycle = "running"
        self._wake.bind()
        log.info("scheduler_started", loop=self.config.loop)
        task_status.started()
        try:
            with self.executor.serving():
                async with anyio.create_task_group() as tg:
                    self._background = tg
                    tg.start_soon(self._pump_inbox)
                    try:
                        await LOOPS[self.config.loop](self)
                        await self.stepper.drain()
                    finally:
                        tg.cancel_scope.cancel()
        finally:
            self._background = None
            with anyio.CancelScope(shield=True):
                await self._shutdown()

    async def aclose(self) -> None:
        """Stop serving: the step in flight completes (or times out), then every open
        request ends with one ``error`` (SchedulerClosedError); the worker stops."""
        if self.state.lifecycle == "new":
            self.state.lifecycle = "closing"
            with anyio.CancelScope(shield=True):
                await self._shutdown()
            return
        if self.state.lifecycle == "running":
            self.state.lifecycle = "closing"
            self.wake()
        await self._stopped.wait()

    async def _shutdown(self) -> None:
        """End everything; ``_stopped`` is set even if a part of closing raises, so no
        caller of ``aclose`` can wait for ever."""
        try:
            await self._close_everything()
        finally:
            self.state.lifecycle = "closed"
            self._stopped.set()

    async def _close_everything(self) -> None:
        self.state.lifecycle = "closing"
        self.emission.deliver()  # what the last synchronous step sent
        for msg in take_buffered(self._inbox_rx):
            self.intake.put(msg)
        await self.executor.aclose(self.stepper.watchdog.close_wait_s())
        closed = errors.SchedulerClosedError("aborted: scheduler closed")
        with self.emission.coalesced():
            for rid in self.intake.take_all_arrived_new():
                if not self.emission.is_live(rid):
                    self.emission.reject(rid, closed)
            for payload in self.intake.admission.drain_all():
                self.emission.reject(payload.request_id, closed)
            self.intake.shutdown()
            for req in self.core.abort_all():
                self.emission.fail(req.rid, errors.SchedulerClosedError("aborted: scheduler closed", output_ids=req.output_ids))
            for rid in list(self.emission.live):
                self.emission.fail(rid, errors.SchedulerClosedError("aborted: scheduler closed"))
        self.core.flush_cache()  # nothing holds KV now: the cached prefixes go too
        self.admin_channel.close()
        self.inbox.close()
        self._outbox_tx.close()
        log.info("scheduler_stopped")

    async def _pump_inbox(self) -> None:
        async for msg in drain_stream(self._inbox_rx):
            self.intake.put(msg)
            self._wake.set()

    def attach_output_sink(self, sink: OutputSink, *, columns: ColumnsSink | None = None) -> None:
        """Deliver messages to ``sink`` (one call per step, on the loop thread) instead
        of the ``outbox``: an embedding layer's fast path. With ``columns``, every
        delivery goes there instead, a step's plain stream rows as one ``StepTokens``
        and the other messages beside it. Attach before serving."""
        if self.state.lifecycle != "new":
            raise RuntimeError("attach the output sink before the scheduler runs")
        self.emission.sink = sink
        self.emission.columns_sink = columns

    def add_step_observer(self, observe: Callable[[float], None]) -> None:
        """Call ``observe(seconds)`` after each processed step (launch to processed)."""
        self.stepper.step_observers.append(observe)

    # ================================================================ waking

    def wake(self) -> None:
        self._wake.set()

    async def begin_iteration(self) -> None:
        """The head of every loop iteration: one scheduling point, then admin, arrivals
        and admission, and reaping of aborted requests.

        The scheduling point is explicit because nothing else guarantees one: when the
        device keeps up, a step launched inline finds its completion already recorded,
        and every await of the iteration returns at once. Measured on the H200 without it,
        the caller's other tasks (stream readers, an HTTP server, a 1 ms ticker) then did
        not run for 0.4-0.6 s, a whole decode phase of 256 requests."""
        self.stats.iterations += 1
        await anyio.lowlevel.checkpoint()
        self._wake.clear()
        if self.admin_channel.pending:  # an action may wait (a drain, a weight update): nothing held behind it
            self.emission.deliver()
        with self.emission.coalesced():
            await self.admin_channel.serve(self._background)
            await self.intake.receive_and_admit()
            if self.intake.has_arrivals():  # what a cold burst left: the next iteration takes it
                self._wake.set()
            for req in self.core.reap_aborted():
                self.emission.finish(req)

    # ================================================================ the thread-safe door

    def submit_threadsafe(self, msg: IncomingMessage) -> None:
        """Put a message in the inbox from a thread that is not the loop's. A malformed
        message raises here, in the sender's thread."""
        if self.closed:
            raise errors.SchedulerClosedError("scheduler is closed")
        if not isinstance(msg, IncomingMessage) or not isinstance(msg.request_id, str) or not msg.request_id:
            raise errors.InvalidRequestError(f"submit_threadsafe takes an IncomingMessage with a non-empty str request_id, got {msg!r}")
        self._wake.call_in_loop(self.inbox.send_nowait, msg)

    def abort_threadsafe(self, request_id: str) -> None:
        self._wake.call_in_loop(self.abort, request_id)

    # ================================================================ aborts

    def abort(self, request_id: str) -> None:
        """Abort wherever the request is. A request not yet admitted or waiting ends now;
        a running one ends at the next step boundary. Exactly one terminal message."""
        rid = request_id
        found = False
        with self.emission.coalesced():
            if self.intake.remove_arrived(rid) and not self.emission.is_live(rid):
                found = True
                self.emission.reject(rid, errors.RequestAbortedError("aborted before admission"))
            if self.intake.admission.remove(rid):
                found = True
                self.emission.reject(rid, errors.RequestAbortedError("aborted before admission"))
            req = self.core.abort(rid)
            if req is not None:
                found = True
                self.emission.finish(req)
            elif self.emission.is_live(rid):
                found = True  # running: marked, reaped at the next boundary
        # An id found nowhere either ended already or has not arrived yet: only the
        # latter must be refused when it arrives.
        self.intake.add_tombstone(rid, handled=found or rid in self.emission.ended)
        if self._abort_callback is not None:
            try:
                self._abort_callback(rid)
            except Exception as exc:
                log.error("scheduler_abort_callback_failed", request_id=rid, error=repr(exc))
        self.wake()

    # ================================================================ admin

    async def admin(self, action: str, payload: dict[str, Any] | None = None) -> dict[str, Any]:
        """Run an admin action at the top of a loop iteration (also while paused)."""
        request = AdminRequest(str(action), dict(payload or {}))
        if not self.serving:
            if self.closed:
                return failure("scheduler closed")
            return await self.admin_channel.run_now(request)
        self.admin_channel.post(request)
        self.wake()
        return await await_future(request.reply)

    def admin_threadsafe(self, action: str, payload: dict[str, Any] | None = None, timeout: float | None = None) -> dict[str, Any]:
        """The admin door for other threads: waits up to ``timeout`` (default from
        config) and answers with a failure when it expires. From the loop's own thread
        it raises at once: waiting there would block the very loop that must answer."""
        if self._wake.on_loop_thread():
            raise errors.AdminError("admin_threadsafe was called on the event loop's thread: use `await scheduler.admin(...)` there")
        payload = dict(payload or {})
        timeout = float(payload.pop("_admin_timeout_s", timeout if timeout is not None else self.config.admin_timeout_s))
        if not self.serving:
            return failure("scheduler is not serving")
        request = AdminRequest(str(action), payload)
        self._wake.call_in_loop(self._admin_from_thread, request)
        try:
            return request.reply.result(timeout=timeout)
        except TimeoutError:
            request.reply.cancel()
            return failure(f"admin operation timed out after {timeout:.1f}s", error="admin operation timed out")

    def _admin_from_thread(self, request: AdminRequest) -> None:
        if self.admin_channel.post(request):
            self.wake()

    # ================================================================ introspection

    def active_request_ids(self) -> list[str]:
        return self.control.active_request_ids()

    def info(self) -> dict[str, Any]:
        return self.control.info()

    @property
    def limits(self) -> ModelLimits:
        """What requests are checked against (vocabulary, context, KV capacity, EOS)."""
        return self.door.limits

    @limits.setter
    def limits(self, limits: ModelLimits) -> None:
        self.door.limits = limits

    @property
    def admission(self) -> Any:
        """The admission stages (builds, backlog, deferral), for introspection."""
        return self.intake.admission

    @property
    def default_request_builder(self) -> RequestBuilder:
        return self.door.build_default

    @property
    def weight_version(self) -> str | None:
        return self.state.weight_version

