"""The event loops, each a coroutine over an AsyncOmniScheduler."""

from __future__ import annotations

from typing import TYPE_CHECKING, Awaitable, Callable

from .async_decode import async_decode_loop
from .normal import normal_loop
from .overlap import overlap_loop

if TYPE_CHECKING:
    from ..scheduler import AsyncOmniScheduler

LOOPS: dict[str, Callable[["AsyncOmniScheduler"], Awaitable[None]]] = {
    "normal": normal_loop,
    "overlap": overlap_loop,
    "async_decode": async_decode_loop,
}

__all__ = ["LOOPS", "async_decode_loop", "normal_loop", "overlap_loop"]
