"""Per-position conditioning rows supplied from outside a stage: a talker's view of the
thinker's hidden states.

Why: an omni talker's input at each position is its token embedding plus a projection
of the thinker's hidden state for the matching thinker token. The thinker produces those
rows at its own pace, so a talker request may only compute a position once the row for
it has arrived, or once the thinker has finished (then the position gets no row: a zero
vector). This module holds the bookkeeping the batch core needs for that rule (how many
rows arrived, whether more can come) and the rows themselves as opaque objects (device
tensors of shape ``[n, H]``, appended as the thinker's stream chunks arrive); the core
never looks inside them, the runner gathers them.

Position ``p`` of the request's sequence takes row ``p - start`` (no row before
``start``). The same rule holds for a prefill (first or after a retraction) and for every
forward of a decode step, which is what keeps the tokens of a conditioned request the
same in every loop.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepConditioning:
    """Rows for positions ``start, start + 1, ...`` of one request, as they arrive."""

    start: int = 0
    chunks: list[Any] = field(default_factory=list)  # [n_i, H] each, in arrival order
    ends: list[int] = field(default_factory=list)  # cumulative row counts after each chunk
    closed: bool = False  # no more rows will come (the producer finished or failed)

    @property
    def available(self) -> int:
        return self.ends[-1] if self.ends else 0

    def add(self, rows: Any) -> None:
        """Append ``rows`` (``[n, H]``; anything with ``shape[0]``)."""
        n = int(rows.shape[0])
        if n:
            self.chunks.append(rows)
            self.ends.append(self.available + n)

    def close(self) -> None:
        self.closed = True

    def ready_through(self, position: int) -> bool:
        """Whether every position up to ``position`` (inclusive) can be computed now."""
        return self.closed or position - self.start < self.available

    def positions_ready(self, first: int, wanted: int) -> int:
        """How many of the ``wanted`` positions from ``first`` on can be computed now
        (all of them once closed)."""
        if self.closed:
            return wanted
        return max(0, min(wanted, self.available + self.start - first))

    def pieces(self, first: int, count: int) -> list[tuple[int, Any]]:
        """The rows of positions ``first .. first + count - 1`` that exist, as
        ``(offset in the range, rows)`` pieces (views of the arrived chunks); positions
        before ``start`` or past the arrived rows have none."""
        lo = max(first - self.start, 0)
        hi = min(first + count - self.start, self.available)
        out: list[tuple[int, Any]] = []
        if hi <= lo:
            return out
        i = bisect_right(self.ends, lo)
        while lo < hi:
            begin = self.ends[i - 1] if i else 0
            end = min(self.ends[i], hi)
            chunk = self.chunks[i]
            piece = chunk if (lo == begin and end - begin == chunk.shape[0]) else chunk[lo - begin : end - begin]
            out.append((lo + self.start - first, piece))
            lo = end
            i += 1
        return out


def ready_positions(req: Any, wanted: int) -> int:
    """How many of the ``wanted`` positions from ``req.num_cached`` on the request may
    compute now: all of them for a plain request, those whose rows arrived (or all,
    once closed) for a conditioned one. The batch core's one rule for conditioning."""
    cond = req.conditioning
    return wanted if cond is None else cond.positions_ready(req.num_cached, wanted)
