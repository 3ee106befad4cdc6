"""Callbacks that do not keep their owner alive.

A stage's parts call back into their owner (the scheduler's wake-up, the engine's router).
Held as plain bound methods, owner and parts would form a reference cycle, and a closed
engine with everything it holds would wait for a cyclic GC pass to be freed. Held through
:func:`weak_method`, reference counting frees them when the last user reference goes."""

from __future__ import annotations

import weakref
from typing import Any, Callable

__all__ = ["weak_method"]


def weak_method(method: Callable[..., Any], *first_args: Any) -> Callable[..., Any]:
    """``method`` (a bound method) as a callable that does not keep its object alive;
    ``first_args`` (held strongly) go before the call's own arguments.

    Once the object is gone the callable does nothing and returns None: nobody is left to
    call back to (a closed stage, or an engine its user dropped)."""
    ref = weakref.WeakMethod(method)  # type: ignore[arg-type]

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*first_args, *args, **kwargs)

    call.__qualname__ = f"weak {getattr(method, '__qualname__', repr(method))}"
    return call
