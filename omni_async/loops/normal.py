"""The normal loop: schedule a step, await it, process it. No step overlaps another on the
device. Idle, it awaits its channels; busy, it awaits the model.

Once a decode step's tokens are on the host, the step after it may be launched before it is
processed (``Stepper.finish_in_sync``'s early launch, when the core can decide that step from
those tokens alone): that step is then in flight at the next turn, and is completed there.
"""

from __future__ import annotations

from ..stage.stepper import SteppedStage


async def normal_loop(stage: SteppedStage) -> None:
    st = stage.stepper
    while stage.serving:
        await stage.begin_iteration()
        if st.in_flight:  # launched early, before the step ahead of it was processed
            await st.finish_in_sync(early=True)
        else:
            await st.step_in_sync(st.next_batch(), early=True)
