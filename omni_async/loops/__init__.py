"""The event loops: each a short policy over the :class:`~omni_async.stage.stepper.Stepper`
(how many steps may be in flight, and for which batches), run by the stage that owns it
(:class:`~omni_async.stage.stepper.SteppedStage`: the head of every iteration is the stage's)."""

from __future__ import annotations

from typing import Awaitable, Callable

from ..stage.stepper import SteppedStage
from .async_decode import async_decode_loop
from .normal import normal_loop
from .overlap import overlap_loop

LOOPS: dict[str, Callable[[SteppedStage], Awaitable[None]]] = {
    "normal": normal_loop,
    "overlap": overlap_loop,
    "async_decode": async_decode_loop,
}

__all__ = ["LOOPS", "async_decode_loop", "normal_loop", "overlap_loop"]
