"""Bounded id bookkeeping: a window of recently seen ids that forgets the oldest."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

V = TypeVar("V")


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
