"""The stepper: the one step path every loop uses.

It owns the steps in flight (a queue of depth 0 or 1), launches a step on the worker
thread, awaits its device completion cooperatively, has the runner collect its output,
and hands the output to its sink (the emission) for processing. A failed step is
handled here too. The loops in :mod:`omni_async.loops` are policies over it: how many
steps may be in flight, and for which batches. The stage that owns it runs the head of
each iteration (:class:`SteppedStage`); the stepper never calls back up.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import anyio

from .. import errors
from ..core.protocol import BatchCore, ScheduledBatchLike, StepRunner
from ..core.request import step_waits_for_host
from .executor import StepExecutor
from ..logs import debug_enabled, log
from ..core.runner_io import ModelRunnerOutput, SchedulerOutput, SchedulerRequest
from .channels import WakeSignal
from .state import IdWindow, StageState
from .watchdog import AUTO, StepWatchdog


@dataclass
class StepStats:
    """Counters of the step path, readable through the stage's ``info()``."""

    iterations: int = 0
    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    # Rows times forwards of the decode steps launched (a multi-step launch runs its
    # longest row's forwards for every row): the device's decode work, set against the
    # tokens it kept (forwards of guesses a grammar refused are dropped, structured.optimistic).
    decode_row_forwards: int = 0
    tokens_out: int = 0
    failed_steps: int = 0
    lookahead_steps: int = 0
    early_steps: int = 0  # steps launched before the step ahead of them was processed (normal loop)
    trace: list[str] = field(default_factory=list)  # filled only while tracing


@dataclass
class InflightStep:
    """A step handed to the device whose output the host has not processed yet."""

    batch: ScheduledBatchLike
    sched_output: SchedulerOutput
    future: "concurrent.futures.Future[Any] | None"  # None when queueing the launch failed
    lookahead: bool = False
    error: BaseException | None = None
    launched_at: float = 0.0
    # Only its forward is enqueued: it samples under late masks once every step before it
    # is processed (Stepper._sample_late).
    masks_due: bool = False


def scheduler_requests(reqs: list[Any]) -> list[SchedulerRequest]:
    """The runner's view of a step's rows: each request's own ``SchedulerRequest``,
    made at its first step and reused while its ``data`` is the same (a running request
    is in every decode step, so the step costs a lookup per row, not an object)."""
    return [e if (e := r.sched_entry) is not None and e.data is r.data else _sched_entry(r) for r in reqs]


def _sched_entry(req: Any) -> SchedulerRequest:
    entry = req.sched_entry = SchedulerRequest(request_id=req.rid, data=req.data)
    return entry


class StepSink(Protocol):
    """What the stage does with a step: see its output, or its failure."""

    def on_step_output(self, batch: Any, out: ModelRunnerOutput) -> None: ...
    def on_step_failed(self, batch: Any, exc: BaseException) -> None: ...
    def defer(self) -> None: ...
    def deliver(self) -> None: ...
    @property
    def deferred(self) -> bool: ...


class SteppedStage(Protocol):
    """What a loop drives: the stage that owns the stepper and runs the head of each
    iteration (admin, arrivals, admission, reaping) before the loop's step."""

    stepper: "Stepper"

    @property
    def serving(self) -> bool: ...

    async def begin_iteration(self) -> None: ...


class Stepper:
    def __init__(
        self,
        core: BatchCore,
        runner: StepRunner,
        executor: StepExecutor,
        sink: StepSink,
        *,
        wake: WakeSignal,
        state: StageState,
        config: Any,
        stats: StepStats | None = None,
        watchdog: StepWatchdog | None = None,
    ) -> None:
        self.core = core
        self.runner = runner
        self.executor = executor
        self.sink = sink
        self.config = config
        self.stats = stats or StepStats()
        self.tracing = False
        self.watchdog = watchdog or StepWatchdog.for_runner(getattr(config, "step_timeout_s", AUTO), runner)
        self.wake = wake  # what an idle step awaits: arrivals, aborts, admin, builds, close
        self.state = state
        self._inflight: deque[InflightStep] = deque()
        # Called with each processed step's seconds from launch to processed (metrics).
        self.step_observers: list[Callable[[float], None]] = []
        self._prefill_logged: IdWindow[None] = IdWindow(10_000, 5_000)

    # ------------------------------------------------------------ what loops read

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    def next_batch(self) -> ScheduledBatchLike | None:
        """The batch core's next step; None while generation is paused."""
        if self.state.paused:
            return None
        return self.core.get_next_batch()

    def lookahead_eligible(self, batch: ScheduledBatchLike) -> bool:
        """A decode batch of at least ``async_decode_min_batch_size`` rows the runner
        accepts for the one-step lookahead."""
        return (
            batch.is_decode
            and batch.size >= self.config.async_decode_min_batch_size
            and not step_waits_for_host(batch)
            and self.runner.lookahead_eligible(batch)
        )

    def overlap_eligible(self, batch: ScheduledBatchLike) -> bool:
        """Whether the overlap loop may run this batch while the previous step is in
        flight (a runner can turn overlap off per batch; a constrained row whose mask needs
        a token still in flight runs in sync, see ``core.request.waits_for_host``)."""
        return not step_waits_for_host(batch) and self.runner.overlap_eligible(batch)

    # ------------------------------------------------------------ the two step shapes

    async def step_ahead(self, batch: ScheduledBatchLike, *, lookahead: bool = False) -> None:
        """Launch ``batch``, then process the step launched before it: one step stays in
        flight while the host works on the previous one. A batch sampling under late
        masks samples after that processing (launch t+1, process t, sample t+1)."""
        await self._launch(batch, lookahead=lookahead, trace="launch")
        if len(self._inflight) > 1:
            await self._until_launched(self._inflight[-1])
            # The previous step's output is often ready already, and nothing below would
            # yield: a turn for the caller's other tasks between the launch and processing.
            await anyio.lowlevel.checkpoint()
            await self._complete(self._inflight.popleft(), trace="resolve")
        if self._inflight[-1].masks_due:
            await self._sample_late(self._inflight[-1])

    async def step_in_sync(self, batch: ScheduledBatchLike | None, *, early: bool = False) -> None:
        """Drain what is in flight, then run ``batch`` to completion. Draining may free
        KV the waiting requests need, so with nothing to run after a drain the loop
        looks again instead of idling. ``early``: see :meth:`finish_in_sync`."""
        if self._inflight:
            await self.drain()
            if batch is None:
                return
            batch = batch.runnable_after_drain()
            if batch is None:
                return
        if batch is None:
            self.sink.deliver()  # nothing launches: what the last step sent goes now
            self.core.on_idle()
            if self.state.serving:  # idle: await the channels
                await self.wake.wait()
            return
        await self._launch(batch, lookahead=False, trace="sync")
        await self.finish_in_sync(early=early)

    async def finish_in_sync(self, *, early: bool = False) -> None:
        """Run the step in flight to completion and process it. ``early`` (the normal
        loop): once its tokens are on the host, the step after it is launched before it is
        processed when the core can decide that step from them (``BatchCore.schedule_early``,
        ``core.early_launch``), so the device runs it while the host processes; it stays in
        flight for the loop's next turn."""
        step = self._inflight.popleft()
        if step.masks_due:
            await self._sample_late(step)
        self.sink.defer()  # delivered once the next step runs (see ``_launch``)
        await self._complete(step, trace=None, early=early)

    async def drain(self) -> None:
        """Process every step in flight (pause, weight updates, shutdown), in launch
        order: a step whose masks are due samples once those before it are processed."""
        while self._inflight:
            step = self._inflight.popleft()
            if step.masks_due:
                await self._sample_late(step)
            await self._complete(step, trace="drain")

    # ------------------------------------------------------------ launch and complete

    async def _launch(self, batch: ScheduledBatchLike, *, lookahead: bool, trace: str) -> None:
        self._count(batch, lookahead)
        if not batch.is_decode and debug_enabled():
            for req in batch.reqs:
                if req.rid not in self._prefill_logged:
                    self._prefill_logged.put(req.rid, None)
                    log.debug("scheduler_prefill_start", request_id=req.rid)
        self._trace(trace, batch)
        sched_output = SchedulerOutput(requests=scheduler_requests(batch.reqs), batch_data=batch)
        # (a step masking between its forwards stays inline too: its host work is Python that
        # holds the GIL, so on the worker it would only trade the loop's turns for GIL hand-offs;
        # measured over the null device, 1.05x [0.83-1.55] the host time a token, bench/RESULTS.md)
        inline = self.executor.launches_inline and batch.is_decode
        if inline:
            await self._until_enqueued()
        try:
            fut = self.executor.launch(self._launch_on_worker, sched_output, lookahead, inline=inline)
        except Exception as exc:
            self._inflight.append(InflightStep(batch, sched_output, None, lookahead, exc))
            self.sink.deliver()
            return
        self._inflight.append(InflightStep(batch, sched_output, fut, lookahead, launched_at=time.perf_counter(),
                                           masks_due=getattr(batch, "late_masks", False)))
        if self.sink.deferred:
            await self._deliver_after_launch(self._inflight[-1], inline)

    async def _deliver_after_launch(self, step: InflightStep, inline: bool) -> None:
        """Deliver what the last synchronous step sent, now that this step runs. A launch
        on the worker feeding a GPU (a prefill) is awaited first: delivering beside it
        would take the GIL from it in switch-interval turns. On CPU the worker's launch is
        the forward itself, which releases the GIL: delivery overlaps it at once."""
        if self.executor.launches_inline and not inline:
            await self._launched(step)
        self.sink.deliver()

    async def _until_enqueued(self) -> None:
        """Before launching on the loop thread: every step launched on the worker before
        it must have enqueued its device work, so device order follows launch order."""
        for step in self._inflight:
            await self._launched(step)

    async def _until_launched(self, step: InflightStep) -> None:
        """A step the loop launched inline would run on the worker only when it is a
        prefill: wait for that launch to end before polling the previous step's
        completion. The poll spins on the loop thread, and two threads that both want the
        GIL take it in switch-interval turns, which slowed the launch feeding the device
        (an 8,192-token prefill launch on the H200: 11 ms alone, 16-19 ms beside the poll)."""
        if self.executor.launches_inline:
            await self._launched(step)

    async def _launched(self, step: InflightStep) -> None:
        """Until ``step``'s launch has returned (at once for an inline launch)."""
        if step.future is not None and not step.future.done():
            try:
                await self.executor.wait(step.future)
            except Exception:
                pass  # that step's own completion reports the failure

    def _launch_on_worker(self, sched_output: SchedulerOutput, lookahead: bool) -> Any:
        return self.runner.launch(sched_output, lookahead=lookahead)

    async def _sample_late(self, step: InflightStep) -> None:
        """Finish a launch that enqueued only its forward (``core.multi_step.late_mask_rows``):
        the runner fills its masks and enqueues sampling, the host copy and the completion
        marker (``sample_pending``), on the thread its launch used. Called once every step
        before it is processed, so its constrained rows' matchers have accepted their last
        tokens. Queued behind the launch without awaiting it: on the worker (CPU) the
        forward may still run, and the loop goes on to schedule the next step. A step of
        several forwards under masks between them (``core.multi_step.late_between``)
        enqueues its later forwards here, after the processing that may have freed a
        finished row's pages (those forwards write past its end): every later launch is
        queued behind this one (the executor runs in order; inline, after
        :meth:`_until_enqueued`), so on the device they come before any reuse of the pages."""
        step.masks_due = False
        inline = self.executor.launches_inline and step.batch.is_decode
        if inline:
            await self._until_enqueued()
        try:
            step.future = self.executor.launch(self._sample_on_worker, step.future, inline=inline)
        except Exception as exc:
            step.future, step.error = None, exc

    def _sample_on_worker(self, launched: "concurrent.futures.Future[Any]") -> Any:
        pending = launched.result()  # done: the executor runs in order (a failed launch raises here)
        return None if pending is None else self.runner.sample_pending(pending)

    async def _complete(self, step: InflightStep, *, trace: str | None, early: bool = False) -> None:
        if trace is not None:
            self._trace(trace, step.batch)
        try:
            out = await self._await_output(step)
        except Exception as exc:
            self.stats.failed_steps += 1
            self.sink.on_step_failed(step.batch, exc)
            return
        if early:
            await self._launch_early(step.batch, out)
        self.sink.on_step_output(step.batch, out)
        if self.step_observers:
            took = time.perf_counter() - step.launched_at
            for observe in self.step_observers:
                try:
                    observe(took)
                except Exception as obs_exc:  # an observer must not break the step path
                    log.error("scheduler_step_observer_failed", error=repr(obs_exc))

    async def _launch_early(self, batch: ScheduledBatchLike, out: ModelRunnerOutput) -> None:
        """Launch the step after ``batch`` before ``batch`` is processed, when nothing the
        head of the next iteration would see is waiting (an arrival, an abort, an admin
        action, a build: they set ``wake``), generation runs, no row failed its sampling,
        and the core decides that step from ``out``'s tokens."""
        if self.wake.is_set() or self.state.paused or not self.state.serving or out.row_errors:
            return
        nxt = self.core.schedule_early(batch, out.token_ids)
        if nxt is not None:
            self.stats.early_steps += 1
            await self._launch(nxt, lookahead=False, trace="early")

    async def _await_output(self, step: InflightStep) -> ModelRunnerOutput:
        if step.future is None:
            raise step.error or RuntimeError("step was not launched")
        timeout = self.watchdog.deadline_s(step.batch)
        try:
            with anyio.fail_after(timeout):  # None: no deadline
                pending = await self.executor.wait(step.future)
                if pending is None:
                    raise RuntimeError("runner produced no output for a non-empty batch")
                await self.executor.completion(pending.event)
        except TimeoutError:
            self.watchdog.timeouts += 1
            raise errors.DeviceTimeoutError(
                f"model step did not complete within step_timeout_s={timeout:g} s"
                + (" (auto: see omni_async/stage/watchdog.py)" if self.watchdog.setting == AUTO else "")
            ) from None
        return self.runner.collect(pending)

    def _count(self, batch: ScheduledBatchLike, lookahead: bool) -> None:
        st = self.stats
        st.steps += 1
        if batch.is_decode:
            st.decode_steps += 1
            steps = getattr(batch, "row_steps", None)
            st.decode_row_forwards += batch.size * (max(steps) if steps else 1)
        else:
            st.prefill_steps += 1
        if lookahead:
            st.lookahead_steps += 1

    def _trace(self, what: str, batch: ScheduledBatchLike | None) -> None:
        if self.tracing:
            self.stats.trace.append(f"{what}:{batch.size if batch is not None else 0}")

