"""The overlap loop: step N's output is processed while step N+1 already runs.

Step N+1 is scheduled and launched before step N's output reaches the host; its decode
inputs for requests still in flight are read from step N's sampled tokens on the device,
so there is no host synchronisation between the two. Rows of requests that finish in
step N are skipped when step N+1 is processed. A batch the runner will not overlap runs
synchronously after a drain.
"""

from __future__ import annotations

from ..stage.stepper import SteppedStage


async def overlap_loop(stage: SteppedStage) -> None:
    st = stage.stepper
    while stage.serving:
        await stage.begin_iteration()
        batch = st.next_batch()
        if batch is not None and st.overlap_eligible(batch):
            await st.step_ahead(batch)
        else:
            await st.step_in_sync(batch)
