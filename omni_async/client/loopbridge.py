"""Using an engine from an event loop other than the one it serves on.

An engine's channels, futures and tasks belong to the loop that started it. A caller on
another loop (a session-scoped engine used by a per-test loop, an engine serving in a
thread of its own) is marshalled onto the engine's loop when that loop is running, and
gets :class:`EventLoopMismatchError` at once when it is not: it never waits on a loop
that cannot answer.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Coroutine, Generic, TypeVar

from ..errors import OmniAsyncError

T = TypeVar("T")


class EventLoopMismatchError(OmniAsyncError, RuntimeError):
    """The engine serves on an event loop that is not running (stopped or closed), so a
    call from this loop cannot be marshalled to it."""


def running_asyncio_loop() -> asyncio.AbstractEventLoop | None:
    """The running asyncio loop, or None under another anyio backend (trio), where an
    engine is bound to the task group of its ``async with`` block instead."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def foreign_loop(own: asyncio.AbstractEventLoop | None) -> bool:
    """True when the caller runs on a loop other than ``own`` (None: not bound yet)."""
    return own is not None and running_asyncio_loop() is not own


def _check_alive(own: asyncio.AbstractEventLoop) -> None:
    if own.is_closed() or not own.is_running():
        state = "closed" if own.is_closed() else "not running"
        raise EventLoopMismatchError(
            f"this engine serves on another event loop, which is {state}: use the engine from the loop "
            "that started it (or keep that loop running in a thread), or create an engine in this loop"
        )


async def run_on(
    own: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T], orphaned: Callable[[T], Any] | None = None
) -> T:
    """Run ``coro`` on ``own`` and await it from the caller's loop. Cancelling the caller
    cancels the coroutine there (which aborts a request awaited by it).

    The coroutine may have returned on ``own`` by the time the caller's cancellation
    arrives (its answer is then dropped with the caller): ``orphaned`` is called with
    that answer on ``own``, exactly once, so that what it made (a submitted request) is
    not left without an owner."""
    try:
        _check_alive(own)
    except EventLoopMismatchError:
        coro.close()
        raise
    handoff: _Handoff[T] = _Handoff(orphaned)
    future = asyncio.run_coroutine_threadsafe(handoff.run(coro), own)
    try:
        return await asyncio.wrap_future(future)
    except asyncio.CancelledError:
        if orphaned is not None:
            call_soon_on(own, handoff.caller_gone)
        raise


class _Handoff(Generic[T]):
    """A coroutine's answer on the engine's loop and whether its caller is still there;
    both sides run on the engine's loop, so exactly one of them finds the other done."""

    def __init__(self, orphaned: Callable[[T], Any] | None) -> None:
        self._orphaned = orphaned
        self._answered = False
        self._answer: Any = None
        self._gone = False

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        answer = await coro
        self._answered, self._answer = True, answer
        if self._gone:
            self._settle()
        return answer

    def caller_gone(self) -> None:
        self._gone = True
        if self._answered:
            self._settle()

    def _settle(self) -> None:
        orphaned, self._orphaned = self._orphaned, None
        if orphaned is not None:
            orphaned(self._answer)


async def maybe_marshal(
    own: asyncio.AbstractEventLoop | None, make: Callable[[], Coroutine[Any, Any, T]], orphaned: Callable[[T], Any] | None = None
) -> T:
    """``await make()`` here when this is the engine's loop, on the engine's loop otherwise
    (``orphaned``: see :func:`run_on`; on the engine's own loop a cancelled caller never
    loses an answer the coroutine gave)."""
    if foreign_loop(own):
        assert own is not None
        return await run_on(own, make(), orphaned)
    return await make()


def call_soon_on(own: asyncio.AbstractEventLoop | None, fn: Callable[[], Any]) -> None:
    """Call ``fn`` on ``own``: now when already there, thread-safely otherwise (dropped
    when that loop is gone: nothing is left to clean up on it)."""
    try:
        here = asyncio.get_running_loop()
    except RuntimeError:
        here = None
    if own is None or here is own:
        fn()
    elif not own.is_closed():
        own.call_soon_threadsafe(fn)


__all__ = ["EventLoopMismatchError", "call_soon_on", "foreign_loop", "maybe_marshal", "run_on", "running_asyncio_loop"]
