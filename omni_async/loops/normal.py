"""The normal loop: schedule a step, await it, process it. Nothing is in flight between
iterations. Idle, it awaits its channels; busy, it awaits the model."""

from __future__ import annotations

from ..stage.stepper import Stepper


async def normal_loop(st: Stepper) -> None:
    while st.serving:
        await st.begin_iteration()
        await st.step_in_sync(st.next_batch())
