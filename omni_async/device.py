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
import threading
from typing import Any, Callable, TypeVar

import anyio
import anyio.lowlevel

from .errors import ConfigError, DeviceTimeoutError

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

    def launch(self, fn: Callable[..., T], *args: Any) -> "concurrent.futures.Future[T]":
        """Queue a step; it starts once the steps queued before it are done."""
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
        finished = await self.drain(timeout_s)
        self._pool.shutdown(wait=finished, cancel_futures=True)
        self.event_waiter.close()

    @property
    def threads(self) -> list[threading.Thread]:
        return list(getattr(self._pool, "_threads", ()))


StepExecutor = ThreadStepExecutor


class EventWaiter:
    """Awaits CUDA events without blocking the loop. Modes (measured in
    ``bench/gpu_suite.py``):

    - ``poll``: ``event.query()`` with a cooperative wait shaped by the recent step
      times: sleep until about 1 ms before the step is expected to end (the loop's
      timers are ~1 ms coarse), then yield with ``sleep(0)`` until the event is done,
      so other coroutines run throughout;
    - ``thread``: a waiter thread blocks in ``event.synchronize()`` (a blocking-sync
      event, so it sleeps) and wakes the loop.

    A watchdog turns a completion that never signals into ``DeviceTimeoutError``.
    """

    def __init__(self, mode: str = "poll", watchdog_s: float = 120.0, spins: int = 8) -> None:
        if mode not in ("poll", "thread"):
            raise ConfigError(f"unknown event wait mode {mode!r}; choose 'poll' or 'thread'")
        self.mode = mode
        self.watchdog_s = watchdog_s
        self.spins = spins
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self.polls = 0
        self.waits = 0
        self._expected_s: float | None = None

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
        if self.mode == "thread":
            if self._thread is None:
                self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="omni-event-wait")
            await await_future(self._thread.submit(event.synchronize))
            return
        start = anyio.current_time()
        expected = self._expected_s
        if expected is not None and expected > 0.002:
            await anyio.sleep(expected - 0.0015)
        while not event.query():
            self.polls += 1
            await anyio.lowlevel.checkpoint()
        took = anyio.current_time() - start
        self._expected_s = took if self._expected_s is None else 0.8 * self._expected_s + 0.2 * took

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)
            self._thread = None
