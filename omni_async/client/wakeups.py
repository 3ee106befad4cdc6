"""Waking stream readers a slice at a time, so one step's wake-ups never hold the loop.

A decode step at batch 256 touches 256 handles. Woken together, all 256 readers run in
the same turn of the event loop, and the caller's other coroutines (an HTTP server, a
1 ms ticker) wait behind every one of them: several milliseconds per step on the H200
host. The waker wakes ``slice_size`` readers and schedules the next slice behind them,
so the loop's timers and other tasks get a turn between slices, and the stage's next
launch interleaves with the readers instead of waiting for the last of them.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterable

from ..logs import log
from .loopbridge import running_asyncio_loop

Wake = Callable[[], None]


class SlicedWaker:
    def __init__(self, slice_size: int = 32) -> None:
        if slice_size < 1:
            raise ValueError("slice_size must be at least 1")
        self.slice_size = slice_size
        self._queue: deque[Wake] = deque()
        self._scheduled = False

    @property
    def pending(self) -> int:
        """Wake-ups not delivered yet."""
        return len(self._queue)

    def wake(self, wakes: Iterable[Wake]) -> None:
        """Queue ``wakes`` behind those already queued; the first slice runs now."""
        self._queue.extend(wakes)
        if not self._scheduled:
            self._wake_slice()

    def _wake_slice(self) -> None:
        self._scheduled = False
        queue = self._queue
        _wake_some(queue, min(self.slice_size, len(queue)))
        if not queue:
            return
        loop = running_asyncio_loop()
        if loop is None or loop.is_closed():  # not on asyncio (trio): wake the rest now
            _wake_some(queue, len(queue))
            return
        self._scheduled = True
        loop.call_soon(self._wake_slice)


def _wake_some(queue: deque[Wake], count: int) -> None:
    """Call the first ``count`` wake-ups (one per reader per step: the loop is inline,
    no call per wake-up around it)."""
    pop = queue.popleft
    for _ in range(count):
        wake = pop()
        try:
            wake()
        except Exception as exc:  # one reader's wake-up must not cost the others theirs
            log.error("reader_wake_failed", error=repr(exc))
