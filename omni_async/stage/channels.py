"""Helpers for the anyio memory object streams the scheduler's channels are made of."""

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
