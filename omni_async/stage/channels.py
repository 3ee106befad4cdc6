"""The anyio plumbing of the scheduler's channels: memory object streams drained, the
outbox as the emission's sink, and the re-armable wake signal its loop waits on (with
the way in from other threads)."""

from __future__ import annotations

import threading
from typing import Any, AsyncIterator, Callable

import anyio

from .executor import threadsafe_caller


async def drain_stream(stream: Any) -> AsyncIterator[Any]:
    """Iterate a memory object stream, taking what is already buffered without a loop
    round trip per item (``receive`` always yields to the loop first), and awaiting only
    when it is empty."""
    while True:
        try:
            yield stream.receive_nowait()
            continue
        except anyio.WouldBlock:
            pass
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            return
        try:
            yield await stream.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            return


def take_buffered(stream: Any) -> list[Any]:
    """Everything already buffered in a memory object stream, without waiting."""
    items = []
    while True:
        try:
            items.append(stream.receive_nowait())
        except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
            return items


class OutboxSink:
    """The emission's sink for a stage used on its own: each message into the outbox."""

    def __init__(self, send_stream: Any) -> None:
        self._tx = send_stream

    def __call__(self, messages: list[Any]) -> None:
        for msg in messages:
            try:
                self._tx.send_nowait(msg)
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                return  # nobody listens any more


class WakeSignal:
    """A re-armable wake signal: anyio events fire once, a loop needs one it can clear.

    It is also the stage's way in from other threads (builds, grammar compiles, the
    thread-safe door): once :meth:`bind` ran on the loop, :meth:`call_in_loop` runs a
    function there. Collaborators hold this object, not the scheduler."""

    def __init__(self) -> None:
        self._event = anyio.Event()
        self._call_soon: Callable[..., None] | None = None
        self._loop_thread: int | None = None

    def bind(self) -> None:
        """Called on the loop that serves the stage, when it starts."""
        self._call_soon = threadsafe_caller()
        self._loop_thread = threading.get_ident()

    def on_loop_thread(self) -> bool:
        return threading.get_ident() == self._loop_thread

    def call_in_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(*args)`` now on the loop's thread (or before the loop runs), else soon on it."""
        call = self._call_soon
        if call is None or self.on_loop_thread():
            fn(*args)
        else:
            call(fn, *args)

    def set_threadsafe(self) -> None:
        self.call_in_loop(self.set)

    def set(self) -> None:
        self._event.set()

    def clear(self) -> None:
        if self._event.is_set():
            self._event = anyio.Event()

    def is_set(self) -> bool:
        return self._event.is_set()

    async def wait(self) -> None:
        await self._event.wait()
