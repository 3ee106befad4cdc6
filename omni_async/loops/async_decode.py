"""The async-decode loop: a one-step lookahead for decode batches.

Launch decode step N (forward, on-device sample, ``post_decode_launch``, completion
marker), then resolve step N-1 (await its completion, ``post_decode_resolve``, process).
Only decode batches of at least ``async_decode_min_batch_size`` rows that the runner
accepts take the lookahead; anything else drains the step in flight and runs
synchronously (the small-batch fast path).
"""

from __future__ import annotations

from ..stage.stepper import SteppedStage


async def async_decode_loop(stage: SteppedStage) -> None:
    st = stage.stepper
    while stage.serving:
        await stage.begin_iteration()
        batch = st.next_batch()
        if batch is not None and st.lookahead_eligible(batch):
            await st.step_ahead(batch, lookahead=True)
        else:
            await st.step_in_sync(batch)
