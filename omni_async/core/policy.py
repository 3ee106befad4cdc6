"""Which requests a step serves first when it cannot serve them all: the batch core's
scheduling policy.

The core decides three things a policy can order: which waiting request is admitted
next (a prefill), which running request is retracted when KV runs short, and, when a
decode step has a row budget (``max_decode_rows``) smaller than the running set, which
rows decode this step (the others sit the step out, keeping their KV and their place).

- :class:`FCFSPolicy`: arrival order everywhere; the newest is retracted first; a capped
  step decodes the oldest rows. With no row budget every running row decodes every step,
  which is what the core did before policies existed.
- :class:`DeadlinePolicy`: least slack first, where the caller says what a request's slack
  is (seconds before its listener runs out of audio, or before its first-chunk deadline);
  the request with the most slack is retracted first and yields its row first. A request
  the caller knows nothing about (slack None) ranks after every known one, by arrival.
  With ``express_tokens`` a multi-step decode is cut short while a row still needs its
  first tokens: the first chunk's express (a new stream's first frames come after the
  forwards they need, not after a whole k-forward launch of the running streams).

Pure scheduling: no clock of its own (the slack function reads one), no asyncio, no torch,
so its properties are tested on the core with a simulated clock.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from .request import Request

__all__ = ["SchedulingPolicy", "FCFSPolicy", "DeadlinePolicy"]


class SchedulingPolicy:
    """The FCFS order; subclasses reorder by a key (smaller: served first)."""

    name = "fcfs"
    # Tokens a request needs before its first chunk can leave (None: no express): while a
    # row has fewer, a decode step runs only the forwards it needs (CoreState.forwards_for).
    express_tokens: int | None = None

    def __init__(self, max_decode_rows: int | None = None) -> None:
        if max_decode_rows is not None and (not isinstance(max_decode_rows, int) or max_decode_rows < 1):
            raise ValueError(f"max_decode_rows must be None or an integer >= 1, got {max_decode_rows!r}")
        self.max_decode_rows = max_decode_rows

    def key(self, req: Request) -> tuple[float, int]:
        """Rank of ``req``: smaller goes first, and is retracted last."""
        return (0.0, req.arrival)

    def caps(self, rows: int) -> bool:
        """Whether a decode step of ``rows`` running rows must leave some out."""
        return self.max_decode_rows is not None and rows > self.max_decode_rows

    def admission_order(self, waiting: Sequence[Request]) -> list[Request]:
        """The waiting requests in the order they are offered a prefill."""
        return sorted(waiting, key=self.key)

    def retract_victim(self, decoding: Sequence[Request]) -> Request:
        """The running request to send back to waiting when KV runs short."""
        return max(decoding, key=self.key)

    def decode_rows(self, decoding: list[Request], limits: list[int]) -> tuple[list[Request], list[int]]:
        """The rows a decode step takes (at most ``max_decode_rows``), in running order."""
        cap = self.max_decode_rows
        if cap is None or len(decoding) <= cap:
            return decoding, limits
        chosen = set(sorted(range(len(decoding)), key=lambda i: self.key(decoding[i]))[:cap])
        keep = [i for i in range(len(decoding)) if i in chosen]
        return [decoding[i] for i in keep], [limits[i] for i in keep]


class FCFSPolicy(SchedulingPolicy):
    """First come, first served (the core's default)."""

    def admission_order(self, waiting: Sequence[Request]) -> list[Request]:
        return list(waiting)  # the queue is kept in arrival order (retractions go back in place)


class DeadlinePolicy(SchedulingPolicy):
    """Least slack first. ``slack(req)``: seconds before ``req`` misses its deadline (its
    listener's buffer runs dry, or its first chunk is due), None when unknown."""

    name = "deadline"

    def __init__(self, slack: Callable[[Request], float | None], max_decode_rows: int | None = None,
                 express_tokens: int | None = None) -> None:
        super().__init__(max_decode_rows)
        if express_tokens is not None and (type(express_tokens) is not int or express_tokens < 1):
            raise ValueError(f"express_tokens must be None or an integer >= 1, got {express_tokens!r}")
        self.slack = slack
        self.express_tokens = express_tokens

    def key(self, req: Request) -> tuple[float, int]:
        s = self.slack(req)
        return (math.inf if s is None else float(s), req.arrival)
