"""The anyio plumbing of the scheduler's channels: memory object streams drained, and
the re-armable wake signal its loop waits on."""

from __future__ import annotations

from typing import Any, AsyncIterator

import anyio


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


class WakeSignal:
    """A re-armable wake signal: anyio events fire once, a loop needs one it can clear."""

    def __init__(self) -> None:
        self._event = anyio.Event()

    def set(self) -> None:
        self._event.set()

    def clear(self) -> None:
        if self._event.is_set():
            self._event = anyio.Event()

    def is_set(self) -> bool:
        return self._event.is_set()

    async def wait(self) -> None:
        await self._event.wait()
