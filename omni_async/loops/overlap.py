"""The overlap loop: step N's result is processed while step N+1 already runs.

Step N+1 is scheduled and launched before step N's result reaches the host; its decode
inputs for requests still in flight are read from step N's sampled tokens on the device
(``Request.last_token_ref``), so there is no host synchronisation between the two.
Rows of requests that finish in step N are skipped when step N+1 is processed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..scheduler import AsyncOmniScheduler, InflightStep


async def overlap_loop(s: "AsyncOmniScheduler") -> None:
    previous: "InflightStep | None" = None

    async def drain() -> None:
        nonlocal previous
        step, previous = previous, None
        if step is not None:
            await s.finish_step(step)

    s.drain_hook = drain
    try:
        while s.serving:
            await s.begin_iteration()
            if s.paused:
                await drain()
                await s.wait_for_work()
                continue
            batch = s.core.get_next_batch()
            current = s.launch_step(batch) if batch is not None else None
            drained = previous is not None
            if drained:
                await drain()  # may free KV that waiting requests need: look again
            previous = current
            if current is None and not drained:
                await s.wait_for_work()
        await drain()
    finally:
        s.drain_hook = None
