"""The admin channel: admin requests queued for the loop and answered at the top of a loop
iteration (also while paused), from the loop's thread or another one. Actions that wait
for the stage to change (a weight update pausing generation) run in the stage's task
group so the loop keeps iterating meanwhile."""

from __future__ import annotations

import math
from typing import Any

import anyio
import anyio.abc

from .admin import BACKGROUND_ACTIONS, AdminRequest, failure, run_admin_action
from .channels import take_buffered
from .control import StageControl


class AdminChannel:
    def __init__(self, control: StageControl) -> None:
        self._control = control
        self._tx, self._rx = anyio.create_memory_object_stream[AdminRequest](math.inf)

    def post(self, request: AdminRequest) -> bool:
        """Queue a request (loop thread); False, with the request answered, once closed."""
        try:
            self._tx.send_nowait(request)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            request.answer(failure("scheduler closed"))
            return False
        return True

    @property
    def pending(self) -> bool:
        """Whether a request waits to be served."""
        return self._rx.statistics().current_buffer_used > 0

    async def serve(self, background: anyio.abc.TaskGroup | None) -> None:
        """Answer what is queued; background actions go to ``background`` when given."""
        for request in take_buffered(self._rx):
            if request.reply.done():
                continue
            if request.action in BACKGROUND_ACTIONS and background is not None:
                background.start_soon(self._serve_in_background, request)
            else:
                request.answer(await run_admin_action(self._control, request))

    async def _serve_in_background(self, request: AdminRequest) -> None:
        try:
            request.answer(await run_admin_action(self._control, request))
        finally:
            request.answer(failure("scheduler closed"))

    def close(self) -> None:
        """Answer every request still queued with a failure, and take no more."""
        for request in take_buffered(self._rx):
            request.answer(failure("scheduler closed"))
        self._tx.close()

    async def run_now(self, request: AdminRequest) -> dict[str, Any]:
        """A request answered at once (the stage is not serving yet)."""
        return await run_admin_action(self._control, request)
