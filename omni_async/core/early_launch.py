"""The next decode step scheduled before this one is processed: the normal loop's early launch (issue 42).

In the normal loop nothing runs on the device while the host processes a step (tokens
appended, finish checks, terminal messages, KV freed, emission), then schedules and
launches the next: on the H200 that gap was ~2.3 ms a step. What the next step needs from
the processing is only which rows end with this step. In steady free decode that is
decided by a few column operations on the step's tokens, so the next step can be
scheduled and launched first, and the step processed while the device runs it.

:func:`schedule_early` does so only when the outcome is the one today's order gives:

- the running set's columns (:class:`.decode_slots.DecodeSlots`) follow this step, every
  running row is in it and no request waits for a prefill (none waiting, none chunked,
  no forced tokens due): after the processing the next step would be a decode step of the
  rows that do not end, from those columns;
- a row ends by length when its column limit (tokens left once this step's land,
  ``Request.tokens_left``'s rule as ``decode_limits`` kept it) is 0; by a stop id by
  :func:`.request.stop_index` over its tokens; by an abort pending (``to_finish``);
- every row stays short of the context with the next step's tokens in flight, so the
  processing's length checks (which count tokens in flight against the context) judge
  each row as they would with nothing in flight;
- the next step's rows fit in KV without the ending rows' pages (else the per-request
  path retracts, after the processing).

Then the step's rows keep their tokens in flight until it is processed (``pending``), the
next step's inputs are their last tokens, and the processing that follows finds every
row as today's order would (tests/test_early_launch.py runs both orders side by side).
"""

from __future__ import annotations

from itertools import compress
from typing import TYPE_CHECKING, Sequence

import numpy as np

from .request import Request, decayed_ratio, stop_index

if TYPE_CHECKING:
    from .batch import ScheduledBatch
    from .core_state import CoreState
    from .decode_slots import DecodeSlots


def schedule_early(core: "CoreState", slots: "DecodeSlots", batch: "ScheduledBatch", tokens: Sequence[int]) -> "ScheduledBatch | None":
    """The decode step after ``batch`` (launched, its ``tokens`` collected: forward-major
    Python ints), scheduled before ``batch`` is processed; None when its outcome is not
    decided as the module says (the caller processes first, as usual). ``slots``: the
    core's running-row columns, which the step follows."""
    if not batch.is_decode or core.waiting or core.chunked is not None or not slots.following(core, batch):
        return None
    n = batch.size
    k = 1 if batch.row_steps is None else max(batch.row_steps)  # a row that runs on ran all k
    if type(tokens) is not list or len(tokens) < k * n or not n or type(tokens[0]) is not int:
        return None
    if int(slots.cached.max()) + 1 + core.decode_plan.most >= core.context_length:
        return None  # a row near the context: its length check counts what is in flight
    keep = ending_rows_kept(slots.reqs, slots.limits, tokens, n, k)  # type: ignore[arg-type]
    if keep is None:
        return None
    last = tokens[(k - 1) * n : k * n]
    alive = None if keep.all() else keep.tolist()
    if alive is not None:
        last = list(compress(last, alive))
    nxt = slots.schedule_after(core, alive, last, k)
    if nxt is not None:
        core.new_token_ratio = decayed_ratio(core.new_token_ratio)
    return nxt


def ending_rows_kept(reqs: list[Request], limits: np.ndarray, tokens: list[int], n: int, k: int) -> np.ndarray | None:
    """Which rows of a step of ``n`` rows and ``k`` forwards run on after it (True) and
    which end with it: by length (``limits``: tokens left once it lands), a stop id or an
    abort pending. None when none runs on."""
    keep = limits > 0
    aborting = [i for i, r in enumerate(reqs) if r.to_finish is not None]
    if aborting:
        keep[aborting] = False
    stops = [r.stop_ids() for r in reqs]
    if any(stops):
        grid = np.array(tokens[: k * n], dtype=np.int64).reshape(k, n)
        for ids in set(stops):  # usually one set (the model's EOS), or two
            if not ids:
                continue
            cols = np.flatnonzero(keep & np.fromiter((s is ids or s == ids for s in stops), bool, n))
            hit = cols[np.isin(grid[:, cols], np.fromiter(ids, np.int64, len(ids))).any(axis=0)]
            for i in hit.tolist():  # a row holding one of its stop ids: the rule, past min_new_tokens
                req = reqs[i]
                if stop_index(tokens[i : k * n : n], ids, len(req.output_ids), req.sampling.min_new_tokens) is not None:
                    keep[i] = False
    return keep if keep.any() else None
