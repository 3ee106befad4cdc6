"""The async-decode loop: one-step lookahead, as in the reference.

Launch decode step N (forward, on-device sample, ``post_decode_launch``, completion
marker), then resolve step N-1 (await its completion, ``post_decode_resolve``, process).
Lookahead is taken only for decode batches of at least ``async_decode_min_batch_size``
rows that the runner accepts; anything else drains the step in flight and runs
synchronously (the bs=1 fast path). Rows finished or retracted by the drain are dropped
from the stale batch before it runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..scheduler import AsyncOmniScheduler, InflightStep


async def async_decode_loop(s: "AsyncOmniScheduler") -> None:
    pending: "InflightStep | None" = None

    async def drain() -> None:
        nonlocal pending
        step, pending = pending, None
        if step is not None:
            s.trace("drain", step.batch)
            await s.finish_step(step)

    s.drain_hook = drain
    min_bs = s.config.async_decode_min_batch_size
    try:
        while s.serving:
            await s.begin_iteration()
            if s.paused:
                await drain()
                await s.wait_for_work()
                continue
            batch = s.core.get_next_batch()
            use_lookahead = (
                batch is not None
                and batch.is_decode
                and batch.size >= min_bs
                and s.runner.lookahead_eligible(batch)
            )
            if use_lookahead:
                launched = s.launch_step(batch, lookahead=True)
                previous, pending = pending, launched
                if previous is not None:
                    s.trace("resolve", previous.batch)
                    await s.finish_step(previous)
                continue
            drained = pending is not None
            if drained:
                await drain()  # may free KV that waiting requests need: look again
                if batch is not None:
                    batch = batch.without_stale_rows()
            if batch is None:
                if not drained:
                    await s.wait_for_work()
                continue
            await s.run_batch(batch)
        await drain()
    finally:
        s.drain_hook = None
