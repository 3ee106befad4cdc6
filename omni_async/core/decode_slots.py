"""A decode step's scheduling as column work while the running set stays free (issue 42).

Between two decode steps of free rows (:func:`.request.all_free`: no grammar, no
conditioning, no top logprobs) processing changes a running request only in ways that
leave its scheduling state where the step left it: tokens move from in flight to kept
(``len(output_ids) + num_inflight`` unchanged), its KV and pages stay, its epoch stays.
Rows leave the running set when they finish and join it at the end after a prefill. So
the state a step reads (length limit, cached tokens, pages held, next generation index,
epoch, page list) can be kept per running row in arrays advanced by each step (limits
minus the forwards taken, cached positions plus them) instead of recomputed from every
request, and the rows that cross a page found with numpy.

:class:`DecodeSlots` holds those columns. The core asks it first for each decode step
(:meth:`DecodeSlots.schedule`); it answers None, and the core takes its per-request
path, whenever anything it does not follow happened: a retraction, a prefill step that
carried decode rows, a jump step, forced tokens due, a constrained or conditioned row, a
step that needs a retraction to fit (rows whose tokens left are all in flight just sit a
step out, as on that path). That path's step
seeds the columns again (:meth:`DecodeSlots.remember`), so both build the same batch
(tests/test_decode_slots.py runs them side by side). The length rule stays
``Request.tokens_left``'s: the columns start from ``decode_limits`` and only subtract.
"""

from __future__ import annotations

from itertools import compress
from typing import TYPE_CHECKING, Any

import numpy as np

from .batch import ForwardMode, decode_inputs
from .request import Request, all_free, decode_limits

if TYPE_CHECKING:
    from .batch import ScheduledBatch
    from .core_state import CoreState


def _ints(values: list[int]) -> np.ndarray:
    return np.fromiter(values, np.int64, len(values))


def _key(core: "CoreState") -> tuple[int, int, int]:
    """What moves when running requests' scheduling state changes outside decode steps:
    retractions (epochs, KV), decode rows carried by prefill or jump steps."""
    return core.num_retractions, core.mixed_decode_rows, core.jump_steps


class DecodeSlots:
    """The running rows' scheduling columns, in ``core.running``'s order (see module)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled  # False: every step takes the per-request path (tests compare the two)
        self.reqs: list[Request] | None = None
        self.key: tuple[int, int, int] = (0, 0, 0)
        self.epochs: list[int] = []
        self.tables: list[list[int]] = []
        self.limits = self.cached = self.counts = self.generated = np.zeros(0, np.int64)
        self.hits = 0  # decode steps scheduled from the columns (stats, tests)
        self.step_id = 0  # the step the columns were last advanced by
        # That step's last token of each row once it was processed with no row ending
        # (:meth:`landed`): the next step's inputs, with nothing in flight (the normal loop).
        self.last_tokens: list[int] | None = None
        # Tokens each of those rows still has in flight besides the next step's: 0 once
        # the step was processed, its forwards when the next step launches before its
        # processing (.early_launch).
        self.last_pending = 0
        # Where each row of the columns sat in the step they last followed (``step_id``),
        # while they hold only that step's rows (some dropped): the next step's
        # ``ScheduledBatch.carried``, so the runner takes its rows' slots by that mask.
        self.origin: np.ndarray | None = None

    def drop(self) -> None:
        self.reqs = None

    def remember(self, core: "CoreState", batch: "ScheduledBatch", limits: list[int], free: bool) -> None:
        """Seed the columns from a decode step the per-request path built: only when every
        running request is free and in it (else the next step takes that path again)."""
        if not (self.enabled and free and batch.size == len(core.running) and not batch.grammar_rows):
            self.drop()
            return
        steps = _ints(batch.row_steps) if batch.row_steps is not None else 1
        self.reqs, self.key = list(batch.reqs), _key(core)
        self.epochs, self.tables = list(batch.epochs), list(batch.page_tables)
        self.limits = _ints(limits) - steps
        self.cached = _ints(batch.prefix_lens) + steps
        self.counts = _ints(batch.page_counts)
        self.generated = _ints(batch.sample_indices) + steps
        self.step_id, self.last_tokens = batch.step_id, None
        self.origin = np.arange(batch.size)

    def landed(self, batch: "ScheduledBatch", tokens: Any) -> None:
        """``batch`` was processed with ``tokens`` (forward-major, Python ints). When it is
        the step the columns follow and every row ran the same forwards, each row's last
        token is one slice of them: the next step's inputs if no row ended meanwhile."""
        if batch.step_id != self.step_id or self.reqs is None or batch.size != len(self.reqs):
            return
        steps, n = batch.row_steps, batch.size
        k = 1 if steps is None else steps[0]
        if type(tokens) is list and len(tokens) >= k * n and (steps is None or steps.count(k) == n):
            self.last_tokens = tokens[(k - 1) * n : k * n] if n and type(tokens[0]) is int else None
            self.last_pending = 0

    def following(self, core: "CoreState", batch: "ScheduledBatch") -> bool:
        """Whether the columns follow ``batch`` as the last step scheduled, every running
        row in it (none sat out), nothing having changed the running set since."""
        return (self.reqs is not None and self.enabled and batch.step_id == self.step_id == core.step_id
                and not core.jump_due and self.key == _key(core) and batch.size == len(self.reqs)
                and core.running == self.reqs)

    def schedule_after(self, core: "CoreState", keep: list[bool] | None, last: list[int],
                       pending: int) -> "ScheduledBatch | None":
        """The step after the one the columns follow (:meth:`following`), before that one
        is processed: its rows that end (``keep`` False) dropped, ``last`` (each kept row's
        last token) as the inputs, ``pending`` tokens of each kept row still in flight."""
        if keep is not None:
            self._keep(keep)
        self.last_tokens, self.last_pending = last, pending
        return self._next(core)

    def _follow_running(self, core: "CoreState") -> bool:
        """Bring the columns to ``core.running``: rows that finished dropped, rows that
        joined after a prefill appended; False when the running set changed otherwise."""
        running, reqs = core.running, self.reqs
        assert reqs is not None
        n = len(reqs)
        if running[:n] != reqs:
            alive = [r.finish_reason is None for r in reqs]
            if running[: alive.count(True)] != list(compress(reqs, alive)):
                return False
            self._keep(alive)
            self.last_tokens = None
            n = len(self.reqs)
        if len(running) > n:  # joined after a prefill step
            self.last_tokens, self.origin = None, None
            tail = running[n:]
            if not all_free(tail):
                return False
            self.reqs = self.reqs + tail
            self.epochs = self.epochs + [r.epoch for r in tail]
            self.tables = self.tables + [r.pages for r in tail]
            self.limits = np.concatenate((self.limits, _ints(decode_limits(tail, core.context_length))))
            self.cached = np.concatenate((self.cached, _ints([r.num_cached for r in tail])))
            self.counts = np.concatenate((self.counts, _ints([len(r.pages) for r in tail])))
            self.generated = np.concatenate((self.generated, _ints([r.num_generated for r in tail])))
        return True

    def _keep(self, alive: list[bool]) -> None:
        """Drop the rows whose ``alive`` is False from every column."""
        assert self.reqs is not None
        keep = np.fromiter(alive, bool, len(alive))
        self.reqs = list(compress(self.reqs, alive))
        self.epochs, self.tables = list(compress(self.epochs, alive)), list(compress(self.tables, alive))
        self.limits, self.cached = self.limits[keep], self.cached[keep]
        self.counts, self.generated = self.counts[keep], self.generated[keep]
        if self.origin is not None:
            self.origin = self.origin[keep]

    def schedule(self, core: "CoreState") -> "ScheduledBatch | None":
        """The next decode step from the columns, or None for the per-request path. Rows
        whose tokens left are all sampled (in flight, the lookahead loops) sit it out, as
        ``multi_step.decoding_rows`` leaves them out."""
        if self.reqs is None or not self.enabled or core.jump_due or self.key != _key(core) or not core.running:
            self.drop()
            return None
        if not self._follow_running(core):
            self.drop()
            return None
        return self._next(core)

    def _next(self, core: "CoreState") -> "ScheduledBatch | None":
        """The step of the rows the columns hold now (see :meth:`schedule`)."""
        limits, cached, counts, sel = self.limits, self.cached, self.counts, None
        low = int(limits.min())
        if low <= 0:
            sel = np.flatnonzero(limits > 0)
            if not len(sel):
                self.drop()
                return None
            limits, cached, counts = limits[sel], cached[sel], counts[sel]
            low = int(limits.min())
        n, ps = len(limits), core.page_size
        if n > core.kv.available_pages:  # the bound of _decode_fits did not hold: its exact count
            most = core.decode_plan.most
            if int(np.maximum(0, -(-(cached + most) // ps) - counts).sum()) > core.kv.available_pages:
                self.drop()
                return None  # (the per-request path retracts)
        k = core.forwards_for(n, self.generated if sel is None else self.generated[sel])
        multi = k > 1 and core.multi_step_allowed()
        if not multi:
            k = 1
        steps: Any = k if low >= k else np.minimum(limits, k)
        return self._fill(core, sel, cached, counts, k if multi else None, steps)

    def _fill(self, core: "CoreState", sel: np.ndarray | None, cached: np.ndarray, counts: np.ndarray,
              k: int | None, steps: Any) -> "ScheduledBatch":
        """The batch's columns as ``ScheduledBatch.fill_decode`` makes them, from the
        arrays (``sel``: the rows that decode, None for all; ``cached``, ``counts``: theirs);
        the requests' cached and in-flight counts written in one pass (processing and the
        per-request path read them); the columns advanced by the step."""
        batch = core.new_batch(ForwardMode.DECODE)
        n = len(cached)
        if sel is None:
            reqs, epochs, tables = list(self.reqs), list(self.epochs), list(self.tables)  # type: ignore[arg-type]
            generated = self.generated
        else:
            rows = sel.tolist()
            reqs = [self.reqs[i] for i in rows]  # type: ignore[index]
            epochs, tables = [self.epochs[i] for i in rows], [self.tables[i] for i in rows]
            generated = self.generated[sel]
        batch.reqs, batch.epochs, batch.page_tables = reqs, epochs, tables
        if self.origin is not None:  # the rows of the step the columns followed, by a mask
            batch.carried = (self.step_id, self.origin if sel is None else self.origin[sel])
        batch.extend_lens, batch.samples_kept = [1] * n, [True] * n
        batch.prefix_lens = cached.tolist()
        batch.sample_indices = generated.tolist()
        after = cached + steps
        ps = core.page_size
        need = -(-after // ps) - counts
        grow = np.flatnonzero(need > 0)
        if len(grow):  # one allocation, handed out in row order (as fill_decode)
            needs = need[grow]
            total = int(needs.sum())
            fresh, growing = core.kv.allocate(total), [tables[i] for i in grow.tolist()]
            if total == len(grow):  # a page each (every row while k <= page_size)
                for pages, page in zip(growing, fresh):
                    pages.append(page)
            else:
                at = 0
                for pages, m in zip(growing, needs.tolist()):
                    pages.extend(fresh[at : at + m])
                    at += m
            counts = counts + np.where(need > 0, need, 0)
        batch.page_counts = counts.tolist()
        last, self.last_tokens = self.last_tokens, None
        if last is not None and sel is None and core.step_id == self.step_id + 1:  # the step before landed, none since
            pending, batch.input_ids = [self.last_pending] * n, last  # (0: its rows' tokens are kept)
        else:
            pending = [r.num_inflight for r in reqs]
            decode_inputs(batch, reqs, pending)
        if type(steps) is int:
            for r, c, p in zip(reqs, after.tolist(), pending):
                r.num_cached = c
                r.num_inflight = p + steps
            batch.row_steps = None if k is None else [steps] * n
        else:
            row_steps = steps.tolist()
            for r, c, p, s in zip(reqs, after.tolist(), pending, row_steps):
                r.num_cached = c
                r.num_inflight = p + s
            batch.row_steps = row_steps
        self._advance(sel, after, counts, steps)
        self.step_id, self.origin = batch.step_id, np.arange(n) if sel is None else None
        return batch

    def _advance(self, sel: np.ndarray | None, cached: np.ndarray, counts: np.ndarray, steps: Any) -> None:
        """The columns after a step: the decoding rows' (``sel``) cached tokens, pages held,
        limits and generation indices; the rows that sat out keep theirs."""
        self.hits += 1
        if sel is None:
            self.cached, self.counts = cached, counts
            self.limits, self.generated = self.limits - steps, self.generated + steps
            return
        self.cached, self.counts = self.cached.copy(), self.counts.copy()
        self.limits, self.generated = self.limits.copy(), self.generated.copy()
        self.cached[sel], self.counts[sel] = cached, counts
        self.limits[sel] -= steps
        self.generated[sel] += steps
