"""What the stage's parts share: its lifecycle state (:class:`StageState`), bounded id
bookkeeping (:class:`IdWindow`) and the guard around user callbacks (:func:`call_user`)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar

from .. import errors

T = TypeVar("T")
V = TypeVar("V")


@dataclass
class StageState:
    """``lifecycle`` moves new -> running -> closing -> closed (the scheduler moves it);
    ``paused`` and ``pause_mode`` are set by the control API; ``weight_version`` names the
    weights results are stamped with (the admin actions update it)."""

    lifecycle: str = "new"
    paused: bool = False
    pause_mode: str | None = None
    weight_version: str | None = None

    @property
    def serving(self) -> bool:
        return self.lifecycle == "running"

    @property
    def closed(self) -> bool:
        return self.lifecycle in ("closing", "closed")


# ---------------------------------------------------------------- Bounded id bookkeeping
# (read by the stepper, intake and control too)

class IdWindow(Generic[V]):
    """An insertion-ordered map of ids with a cap: past ``cap`` entries only the newest
    ``keep`` stay (amortised O(1) per insert)."""

    def __init__(self, cap: int, keep: int) -> None:
        self.cap = cap
        self.keep = keep
        self._items: OrderedDict[str, V] = OrderedDict()

    def put(self, rid: str, value: V) -> None:
        self._items[rid] = value
        self._items.move_to_end(rid)
        if len(self._items) > self.cap:
            while len(self._items) > self.keep:
                self._items.popitem(last=False)

    def pop(self, rid: str, default: V | None = None) -> V | None:
        return self._items.pop(rid, default)

    def get(self, rid: str, default: V | None = None) -> V | None:
        return self._items.get(rid, default)

    def __contains__(self, rid: object) -> bool:
        return rid in self._items

    def __len__(self) -> int:
        return len(self._items)


# ---------------------------------------------------------------- User callbacks
# (read by the stepper, intake and control too)

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
