"""Returning an engine's memory when it closes, without a cyclic GC pass.

Two things make that possible. The stage's parts call back into their owner through
:func:`weak_method`, so an owner and its parts form no reference cycle and reference
counting alone frees them. And closing drops every reference to the device state (the
model, its KV cache, CUDA graphs, the runner's buffers) at once, so the memory comes back
when ``aclose()`` returns even while the caller still holds the closed engine.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import torch

__all__ = ["weak_method", "weak_getter", "release_stage_memory", "empty_device_cache"]


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


def weak_getter(obj: Any, path: str) -> Callable[[], Any]:
    """A callable that reads ``obj.<path>`` (dotted) without keeping ``obj`` alive;
    None once ``obj`` is gone."""
    ref = weakref.ref(obj)
    names = path.split(".")

    def read() -> Any:
        value = ref()
        for name in names:
            if value is None:
                return None
            value = getattr(value, name)
        return value

    return read


def release_stage_memory(device: Any, held: Sequence[tuple[Any, tuple[str, ...]]]) -> None:
    """A closed stage's device state goes now: each ``(part, names)`` in ``held`` stops
    referring to what those attributes held (set to None), and on CUDA the caching
    allocator hands the freed blocks back to the device."""
    for part, names in held:
        for name in names:
            if hasattr(part, name):
                setattr(part, name, None)
    empty_device_cache(device)


def empty_device_cache(device: Any) -> None:
    """Hand the CUDA caching allocator's free blocks back to the device, so the next
    engine (or another process) can use what this one held. Nothing to do on CPU."""
    if device is None:
        return
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_initialized():
        with torch.cuda.device(dev):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
