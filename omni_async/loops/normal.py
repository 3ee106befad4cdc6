"""The normal loop: schedule a step, await it, process it. Nothing is in flight between
iterations. Idle, it awaits its channels; busy, it awaits the model."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..scheduler import AsyncOmniScheduler


async def normal_loop(s: "AsyncOmniScheduler") -> None:
    while s.serving:
        await s.begin_iteration()
        if s.paused:
            await s.wait_for_work()
            continue
        batch = s.core.get_next_batch()
        if batch is None:
            await s.wait_for_work()
            continue
        await s.run_batch(batch)
