"""The normal loop: schedule a step, await it, process it. Nothing is in flight between
iterations. Idle, it awaits its channels; busy, it awaits the model."""

from __future__ import annotations

from ..stage.stepper import SteppedStage


async def normal_loop(stage: SteppedStage) -> None:
    st = stage.stepper
    while stage.serving:
        await stage.begin_iteration()
        await st.step_in_sync(st.next_batch())
