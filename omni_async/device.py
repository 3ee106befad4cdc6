"""Awaiting the device without blocking the event loop.

On CPU a forward is itself blocking compute, so it runs on one dedicated worker thread
and the loop awaits its future: coroutines sharing the loop keep running meanwhile.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class ThreadStepExecutor:
    """Runs model steps one at a time, in order, on one worker thread."""

    def __init__(self, name: str = "omni-forward") -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
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

    @property
    def threads(self) -> list[threading.Thread]:
        return list(getattr(self._pool, "_threads", ()))
