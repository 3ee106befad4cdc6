"""Awaiting the device without blocking the event loop.

Steps are *launched* on one dedicated worker thread (on CPU the launch is the forward
itself; on CUDA it enqueues kernels and records an event) and the loop awaits the
launch's future; on CUDA it then awaits the event cooperatively (see ``EventWaiter``),
so coroutines sharing the loop keep running while the model works and the worker is
free to launch the next step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Callable, TypeVar

T = TypeVar("T")


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
        return await asyncio.wrap_future(fut)

    async def completion(self, event: Any) -> None:
        """Await a device completion marker; None (CPU) is already complete."""
        if event is not None:
            await self.event_waiter.wait(event)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await self.wait(self.launch(fn, *args))

    async def drain(self) -> None:
        """Wait (cooperatively) until no queued step is left running."""
        while self._inflight:
            await asyncio.wait([asyncio.wrap_future(f) for f in list(self._inflight)])

    async def aclose(self) -> None:
        """Finish what is queued, then stop the worker thread."""
        self._closed = True
        await self.drain()
        self._pool.shutdown(wait=True)
        self.event_waiter.close()

    @property
    def threads(self) -> list[threading.Thread]:
        return list(getattr(self._pool, "_threads", ()))


class DeviceTimeoutError(RuntimeError):
    """A device completion did not signal within the watchdog's limit."""


class EventWaiter:
    """Awaits CUDA events without blocking the loop. Modes (measured in
    ``bench/gpu_await.py``):

    - ``poll``: ``event.query()`` with a cooperative wait shaped by the recent step
      times: sleep until about 1 ms before the step is expected to end (the loop's
      timers are ~1 ms coarse), then yield with ``sleep(0)`` until the event is done,
      so other coroutines run throughout;
    - ``thread``: a waiter thread blocks in ``event.synchronize()`` (a blocking-sync
      event, so it sleeps) and wakes the loop;
    - ``hostfunc``: not used here (the callback must be enqueued at launch; see the bench).

    A watchdog turns a completion that never signals into ``DeviceTimeoutError``.
    """

    def __init__(self, mode: str = "poll", watchdog_s: float = 120.0, spins: int = 8) -> None:
        if mode not in ("poll", "thread"):
            raise ValueError(f"unknown event wait mode {mode!r}")
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
            await asyncio.wait_for(self._wait(event), self.watchdog_s)
        except asyncio.TimeoutError:
            raise DeviceTimeoutError(f"device step did not complete within {self.watchdog_s:.0f} s") from None

    async def _wait(self, event: Any) -> None:
        if self.mode == "thread":
            if self._thread is None:
                self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="omni-event-wait")
            await asyncio.wrap_future(self._thread.submit(event.synchronize))
            return
        loop = asyncio.get_running_loop()
        start = loop.time()
        expected = self._expected_s
        if expected is not None and expected > 0.002:
            await asyncio.sleep(expected - 0.0015)
        while not event.query():
            self.polls += 1
            await asyncio.sleep(0)
        took = loop.time() - start
        self._expected_s = took if self._expected_s is None else 0.8 * self._expected_s + 0.2 * took

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
