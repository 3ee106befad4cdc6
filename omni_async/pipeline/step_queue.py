"""A stage's output sink for the pipeline's router (:mod:`.two_stage`)."""

from __future__ import annotations

from collections import deque
from typing import AsyncIterator

import anyio

from ..messages import OutgoingMessage


class StepQueue:
    """A stage's output sink for the router: each step's messages appended in one call
    (on the loop thread, inside the stage's step), read back one by one by the router
    task, which is woken once per batch of steps rather than once per message."""

    def __init__(self) -> None:
        self._messages: deque[OutgoingMessage] = deque()
        self._ready = anyio.Event()
        self._closed = False

    @property
    def pending(self) -> int:
        return len(self._messages)

    def put(self, messages: list[OutgoingMessage]) -> None:
        self._messages.extend(messages)
        self._ready.set()

    def close(self) -> None:
        self._closed = True
        self._ready.set()

    async def __aiter__(self) -> AsyncIterator[OutgoingMessage]:
        messages = self._messages
        while True:
            while messages:
                yield messages.popleft()
            if self._closed:
                return
            self._ready = anyio.Event()
            await self._ready.wait()
