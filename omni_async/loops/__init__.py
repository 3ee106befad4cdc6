"""The event loops, each a coroutine over an AsyncOmniScheduler."""

from __future__ import annotations

from typing import TYPE_CHECKING, Awaitable, Callable

from .normal import normal_loop

if TYPE_CHECKING:
    from ..scheduler import AsyncOmniScheduler

LOOPS: dict[str, Callable[["AsyncOmniScheduler"], Awaitable[None]]] = {
    "normal": normal_loop,
}

__all__ = ["LOOPS", "normal_loop"]
