"""Awaiting the device without blocking the event loop.

Steps are *launched* on one dedicated worker thread (on CPU the launch is the forward
itself; on CUDA it enqueues kernels and records an event) and the loop awaits the
launch's future; on CUDA it then awaits the event cooperatively (see ``EventWaiter``),
so coroutines sharing the loop keep running while the model works and the worker is
free to launch the next step. Everything here is written against anyio, so it runs
under asyncio (uvloop) and trio alike.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import weakref
from typing import Any, Callable, Iterator, TypeVar

import anyio
import anyio.lowlevel

from ..errors import ConfigError, DeviceTimeoutError

T = TypeVar("T")

__all__ = ["DeviceTimeoutError", "EventWaiter", "StepExecutor", "ThreadStepExecutor", "await_future", "threadsafe_caller"]


def threadsafe_caller() -> Callable[..., None]:
    """A function that schedules ``fn(*args)`` on the running event loop from any
    thread: the one primitive anyio lacks for waking a loop from a worker thread without
    blocking that thread."""
    import asyncio

    try:
        return asyncio.get_running_loop().call_soon_threadsafe
    except RuntimeError:  # not asyncio: the other backend anyio runs on
        import trio

        return trio.lowlevel.current_trio_token().run_sync_soon


async def await_future(fut: "concurrent.futures.Future[T]") -> T:
    """Await a ``concurrent.futures.Future`` on any anyio backend. Cancelling the
    awaiting task cancels the future if it has not started."""
    if not fut.done():
        done = anyio.Event()
        call = threadsafe_caller()

        def wake(_f: Any) -> None:
            try:
                call(done.set)
            except RuntimeError:
                pass  # the loop is gone: nobody waits any more

        fut.add_done_callback(wake)
        try:
            await done.wait()
        except BaseException:
            fut.cancel()
            raise
    return fut.result()


class ThreadStepExecutor:
    """Runs model steps one at a time, in order, on one worker thread."""

    def __init__(self, name: str = "omni-forward", event_waiter: "EventWaiter | None" = None) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.event_waiter = event_waiter or EventWaiter()
        self._inflight: set[concurrent.futures.Future[Any]] = set()
        self._closed = False
        # Called once the worker stopped (a backend's processes, a group to release).
        self.on_close: list[Callable[[], None]] = []
        # Called on the loop's thread after on_close: quick, non-blocking releases (the
        # stage's device memory, omni_async.release).
        self.after_close: list[Callable[[], None]] = []

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """While the stage serves: its event waiter counts as a tenant of the running
        loop (``event_wait="auto"`` waits differently when the loop is shared)."""
        with self.event_waiter.tenant():
            yield

    launches_inline = False

    def launch(self, fn: Callable[..., T], *args: Any, inline: bool = False) -> "concurrent.futures.Future[T]":
        """Queue a step; it starts once the steps queued before it are done.
        ``inline`` is a hint only an inline executor takes."""
        if self._closed:
            raise RuntimeError("step executor is closed")
        fut = self._pool.submit(fn, *args)
        self._inflight.add(fut)
        fut.add_done_callback(self._inflight.discard)
        return fut

    async def wait(self, fut: "concurrent.futures.Future[T]") -> T:
        return await await_future(fut)

    async def completion(self, event: Any) -> None:
        """Await a device completion marker; None (CPU) is already complete."""
        if event is not None:
            await self.event_waiter.wait(event)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await self.wait(self.launch(fn, *args))

    async def drain(self, timeout_s: float | None = None) -> bool:
        """Wait (cooperatively) until no queued step is left running; False when
        ``timeout_s`` passed first (a hung step)."""
        with anyio.move_on_after(timeout_s) as scope:
            while self._inflight:
                fut = next(iter(self._inflight))
                try:
                    await await_future(fut)
                except BaseException:
                    if scope.cancel_called:
                        raise
        return not scope.cancelled_caught

    async def aclose(self, timeout_s: float | None = None) -> None:
        """Finish what is queued, then stop the worker thread. A step still running
        after ``timeout_s`` is abandoned: the thread is left to finish on its own (it is
        a daemon of the pool) so closing is bounded."""
        self._closed = True
        try:
            finished = await self.drain(timeout_s)
            self._pool.shutdown(wait=finished, cancel_futures=True)
            self.event_waiter.close()
        finally:
            for close in self.on_close:
                await anyio.to_thread.run_sync(close)
            for release in self.after_close:
                release()

    @property
    def threads(self) -> list[threading.Thread]:
        return list(getattr(self._pool, "_threads", ()))


class InlineStepExecutor(ThreadStepExecutor):
    """Launches decode steps on the calling (loop) thread. On CUDA a graph-replayed
    decode launch only enqueues work (inputs, one replay, sampling, one async copy), so
    running it inline saves the thread hand-off and the GIL ping-pong between the loop
    and a worker; completion is still awaited cooperatively. Launches that enqueue
    thousands of kernels (eager prefill) stay on the worker thread: inline, a full
    launch queue would block the loop. The caller orders the two (an inline launch
    waits until every worker launch before it has been enqueued)."""

    launches_inline = True

    def launch(self, fn: Callable[..., T], *args: Any, inline: bool = False) -> "concurrent.futures.Future[T]":
        if not inline:
            return super().launch(fn, *args)
        if self._closed:
            raise RuntimeError("step executor is closed")
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:  # the stepper reports it as this step's failure
            fut.set_exception(exc)
        return fut


StepExecutor = ThreadStepExecutor


EVENT_WAIT_MODES = ("auto", "poll", "thread")


def make_step_executor(launch: str, device_type: str, event_wait: str) -> ThreadStepExecutor:
    """``launch``: "thread" (a worker thread), "inline" (the loop thread; CUDA only,
    where a launch does not block on compute) or "auto" (inline on CUDA)."""
    waiter = EventWaiter(event_wait)
    if launch == "inline" or (launch == "auto" and device_type == "cuda"):
        if device_type != "cuda":
            raise ConfigError("step_launch='inline' needs CUDA: on CPU a step is blocking compute and would stall the loop")
        return InlineStepExecutor(event_waiter=waiter)
    if launch not in ("thread", "auto"):
        raise ConfigError(f"unknown step_launch {launch!r}; choose 'auto', 'thread' or 'inline'")
    return ThreadStepExecutor(event_waiter=waiter)


class EventWaiter:
    """Awaits CUDA events without blocking the loop. Modes (measured in
    ``bench/gpu_suite.py`` and ``bench/colocate.py``):

    - ``poll``: ``event.query()`` with a cooperative wait shaped by the recent step
      times: sleep until about 1 ms before the step is expected to end (the loop's
      timers are ~1 ms coarse), then yield with ``sleep(0)`` until the event is done,
      so other coroutines run throughout;
    - ``thread``: a waiter thread blocks in ``event.synchronize()`` (a blocking-sync
      event, so it sleeps) and wakes the loop;
    - ``auto`` (the default): ``poll`` while this stage is the only one serving in its
      event loop, ``thread`` while others share the loop. Polling is the quicker wake-up
      for one stage, but two polling stages keep the loop thread spinning through each
      other's waits and hold the GIL against their worker threads' launches: on the
      H200 a thinker and a talker took 2.2 s together with waiter threads and 3.1-3.4 s
      polling (bench/RESULTS.md).

    A watchdog turns a completion that never signals into ``DeviceTimeoutError``.
    """

    # Tenants (serving stages' waiters) of each event loop's thread.
    _tenants: dict[int, "weakref.WeakSet[EventWaiter]"] = {}
    _tenants_lock = threading.Lock()

    def __init__(self, mode: str = "auto", watchdog_s: float = 120.0, spins: int = 8) -> None:
        if mode not in EVENT_WAIT_MODES:
            raise ConfigError(f"unknown event wait mode {mode!r}; choose one of {', '.join(EVENT_WAIT_MODES)}")
        self.mode = mode
        self.watchdog_s = watchdog_s
        self.spins = spins
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self.polls = 0
        self.waits = 0
        self._expected_s: float | None = None

    @contextlib.contextmanager
    def tenant(self) -> Iterator[None]:
        """Count this waiter as serving in the calling thread's event loop."""
        key = threading.get_ident()
        with self._tenants_lock:
            self._tenants.setdefault(key, weakref.WeakSet()).add(self)
        try:
            yield
        finally:
            with self._tenants_lock:
                tenants = self._tenants.get(key)
                if tenants is not None:
                    tenants.discard(self)
                    if not tenants:
                        del self._tenants[key]

    def blocks_in_thread(self) -> bool:
        """Whether the next wait blocks in a waiter thread rather than polling."""
        if self.mode != "auto":
            return self.mode == "thread"
        tenants = self._tenants.get(threading.get_ident())
        return tenants is not None and len(tenants) > 1

    async def wait(self, event: Any) -> None:
        self.waits += 1
        if event.query():
            return
        try:
            with anyio.fail_after(self.watchdog_s):
                await self._wait(event)
        except TimeoutError:
            raise DeviceTimeoutError(f"device step did not complete within {self.watchdog_s:.0f} s") from None

    async def _wait(self, event: Any) -> None:
        if self.blocks_in_thread():
            if self._thread is None:
                self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="omni-event-wait")
            await await_future(self._thread.submit(event.synchronize))
            return
        start = anyio.current_time()
        expected = self._expected_s
        if expected is not None and expected > 0.002:
            await anyio.sleep(expected - 0.0015)
            if event.query():
                # Done before the sleep ended: the steps got shorter (prefill to decode).
                # Averaging in this wait's time would keep the estimate near what the sleep
                # itself lasted, for dozens of steps each waited for far too long.
                self._expected_s = expected / 2
                return
        while not event.query():
            self.polls += 1
            await anyio.lowlevel.checkpoint()
        took = anyio.current_time() - start
        self._expected_s = took if expected is None else 0.8 * expected + 0.2 * took

    @property
    def expected_s(self) -> float | None:
        """How long the next wait is expected to take (poll mode), from the recent ones."""
        return self._expected_s

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)
            self._thread = None
