"""The event loops: each a short policy over the :class:`~omni_async.stage.stepper.Stepper`
(how many steps may be in flight, and for which batches)."""

from __future__ import annotations

from typing import Awaitable, Callable

from ..stage.stepper import Stepper
from .async_decode import async_decode_loop
from .normal import normal_loop
from .overlap import overlap_loop

LOOPS: dict[str, Callable[[Stepper], Awaitable[None]]] = {
    "normal": normal_loop,
    "overlap": overlap_loop,
    "async_decode": async_decode_loop,
}

__all__ = ["LOOPS", "async_decode_loop", "normal_loop", "overlap_loop"]
