"""One guard for every user callback: a callback that raises fails the request it was
called for, with :class:`~omni_async.errors.RequestFailedError` naming the callback,
and nothing else."""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from .. import errors

T = TypeVar("T")


def call_user(what: str, fn: Callable[..., T], *args: Any) -> T:
    """Call a user callback; its exception becomes a typed error for its request.
    The library's own typed errors pass through unchanged."""
    try:
        return fn(*args)
    except errors.OmniAsyncError:
        raise
    except Exception as exc:
        err = errors.RequestFailedError(f"{what} failed: {exc!r}")
        raise err from exc
