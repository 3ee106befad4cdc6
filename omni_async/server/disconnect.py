"""A whole (not streamed) response raced against its client: a client that goes away
aborts its request instead of leaving it to run for nobody."""

from __future__ import annotations

from typing import Any, Awaitable

import anyio
from fastapi import Request

from .errors import single_error


async def until_disconnect(request: Request, work: Awaitable[Any]) -> tuple[bool, Any]:
    """Await ``work`` unless the client disconnects first (then ``work`` is cancelled,
    which aborts its request). Returns (completed, value)."""
    outcome: list[Any] = []
    try:
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            outcome.append(await work)
            tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:  # the request's own error (queue full ...), unwrapped
        raise single_error(group) from None
    return (True, outcome[0]) if outcome else (False, None)
