"""Grammar masks computed ahead, on a thread of their own, while the loop does other work.

A constrained row's next mask depends only on the tokens its matcher has accepted, so it
can be computed as soon as the host has processed the row's last token, long before the
step that samples under it is launched. The batch core queues the matchers of one
processed step together (:func:`omni_async.structured.grammar.prefetch_all`), once all of
the step's tokens are accepted, as one :class:`MaskTicket`; a request's first mask is
queued alone at admission. The worker computes everything queued since it last looked in
one library call into one array, and the step's fill only copies from it (waiting when it
is not done yet). llguidance releases the GIL while it computes, so the loop (and, on
CUDA, the launch feeding the device) runs meanwhile.

Why one call per step and not one per row: a row computed by a Python loop on the
worker takes the GIL back after it, and while the loop thread runs Python the worker
waits for it (up to the interpreter's switch interval, 5 ms) at every row. The H200 run
of 2026-12-04 saw 112 us a row, serially, on a 16-core host, with the rows of a step
arriving one by one (each accept woke the worker for one row, so llguidance's pool, for
16+ rows, was rarely taken). By default the worker computes a ticket's rows one by one,
one wake-up per step: on both hosts measured, llguidance's pool was slower than that (see
``pool_threads``). Where ``OMNI_ASYNC_GRAMMAR_THREADS`` asks for a pool, a ticket goes to
it in one call that holds no GIL for any of its rows (``grammar_mask_threads`` in
``info()``), and ``submit`` hands it over to the worker (see there).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np

# llguidance's pool for a ticket: off unless OMNI_ASYNC_GRAMMAR_THREADS=N asks for N threads.
# Measured (bench/probes/grammar_batch.py, 128 rows a ticket): on the H200's host (16 CPUs, a
# sandboxed VM) one thread took 5.8 ms a ticket, a pool of 4 7.8 ms, of 15 10.4 ms
# (bench/results/h200_2026-12-04_evening/gb_t*.json); on the 2-core dev VM its threads lost
# to one at 4-64 rows (bench/probes/grammar_libraries.py). Where a pool is asked for, a fill
# computing rows itself (batch_mask.compute_rows) uses it from PARALLEL_MIN_ROWS rows.
PARALLEL_MIN_ROWS = 16
# The longest a submit waits for an idle worker to take its ticket (a safety bound: the
# hand-over takes one thread wake-up).
HANDOVER_TIMEOUT_S = 0.05


def host_cpus() -> int:
    """CPUs this process may run on (the affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def pool_threads(cpus: int | None = None) -> int:
    """llguidance's pool for the mask worker: ``OMNI_ASYNC_GRAMMAR_THREADS`` threads (at most
    every CPU but one, ``cpus``: the host's by default); 0 (no pool: one thread computes)
    when it is unset, below 2, or not a number."""
    try:
        asked = int(os.environ.get("OMNI_ASYNC_GRAMMAR_THREADS", "0"))
    except ValueError:
        return 0
    cpus = host_cpus() if cpus is None else cpus
    return min(asked, max(1, cpus - 1)) if asked >= 2 else 0


class MaskTicket:
    """The next masks of matchers queued together: ``masks[j]`` (``[words]`` int32) is
    the j-th handle's once ``done`` is set and ``ok[j]`` is true (false: the library
    refused; the fill computes that row itself and meets the error there)."""

    __slots__ = ("handles", "masks", "ok", "done")

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles
        self.masks: np.ndarray | None = None
        self.ok: np.ndarray | None = None
        self.done = threading.Event()

    def mask(self, j: int) -> np.ndarray | None:
        """Row ``j``'s mask (waiting for the worker while it computes), or None."""
        if not self.done.is_set():
            self.done.wait()
        ok = self.ok
        return self.masks[j] if ok is not None and ok[j] and self.masks is not None else None


class MaskWorker:
    """One daemon thread computing queued tickets' masks (``words`` int32 each)."""

    def __init__(self, words: int) -> None:
        self.words = words
        self._cond = threading.Condition(threading.Lock())
        self._queue: list[MaskTicket] = []
        self._thread: threading.Thread | None = None
        self._closed = False
        self._idle = False  # the worker waits for work (a submit then hands its ticket over)
        self._executor: Any = None
        self.threads = pool_threads()
        # Counters for info(): masks computed here, their seconds, the library calls (one
        # per wake-up) and the forced masks (exactly one token admissible: a forward the
        # grammar decided alone).
        self.rows = 0
        self.seconds = 0.0
        self.calls = 0
        self.forced = 0
        # Jump-forwards (structured.jump, on the loop thread): runs and the tokens they skipped.
        self.jumps = 0
        self.jumped = 0
        self.forced_inline = 0  # forced masks a jump-forward computed on the loop thread
        # Optimistic rows (structured.optimistic, on the loop thread): tokens sampled before
        # their mask and admitted, and those refused (each a rewind).
        self.guessed = 0
        self.refused = 0

    def submit(self, handles: list[Any]) -> MaskTicket | None:
        """Queue the next masks of ``handles`` (library matchers, none in use elsewhere
        until the ticket is done) as one ticket; None once closed.

        When the worker is idle and the ticket goes to the pool, this waits until the
        worker has taken it: the worker needs the GIL to wake and reach the library call
        (which then releases it), and a loop thread running Python hands the GIL over only
        every switch interval (5 ms), so without the hand-over the masks were often
        computed only once the loop waited for them at the fill. The wait is one thread
        wake-up per step. A request's first mask, queued alone at admission, is needed only
        after its prefill: no wait."""
        ticket = MaskTicket(handles)
        with self._cond:
            if self._closed:
                return None
            self._queue.append(ticket)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="omni-grammar-masks", daemon=True)
                self._thread.start()
            self._cond.notify_all()
            if self._idle and self.threads and len(handles) > 1:  # a pool call (see _compute)
                self._cond.wait_for(lambda: not self._queue or self._closed, timeout=HANDOVER_TIMEOUT_S)
        return ticket

    def close(self) -> None:
        """Stop taking work; what is queued is still computed (its owners wait on it)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def stats(self) -> dict[str, float]:
        return {"grammar_mask_prefetched_rows": self.rows, "grammar_mask_worker_s": self.seconds,
                "grammar_mask_worker_calls": self.calls, "grammar_mask_threads": self.threads,
                "grammar_forced_masks": self.forced + self.forced_inline, "grammar_jumps": self.jumps,
                "grammar_forced_skipped": self.jumped, "grammar_optimistic_tokens": self.guessed,
                "grammar_optimistic_refused": self.refused}

    def count_jump(self, tokens: int) -> None:
        self.jumps += 1
        self.jumped += tokens

    def count_inline(self, buf: np.ndarray) -> None:
        """Count a mask computed on the loop thread (``GrammarMatcher.mask_now``) if forced."""
        if int(np.bitwise_count(buf.view(np.uint32)).sum()) == 1:
            self.forced_inline += 1

    def _run(self) -> None:
        while True:
            with self._cond:
                self._idle = True
                while not self._queue and not self._closed:
                    self._cond.wait()
                self._idle = False
                if not self._queue:
                    return
                todo, self._queue = self._queue, []
                self._cond.notify_all()  # a submitter waiting for the hand-over
            t0 = time.perf_counter()
            try:
                self._compute(todo)
            except Exception:  # the thread carries on: a ticket without masks sends the fill to compute them
                pass
            finally:  # never leave an owner waiting
                for ticket in todo:
                    ticket.done.set()
            self.seconds += time.perf_counter() - t0

    def _compute(self, todo: list[MaskTicket]) -> None:
        """Every queued ticket's rows in one array, by one library call where a pool
        pays (else a loop here), then each ticket given its slice."""
        handles = [h for ticket in todo for h in ticket.handles]
        n = len(handles)
        masks = np.empty((n, self.words), dtype=np.int32)
        ok = np.ones(n, dtype=bool)
        if self.threads and n > 1:  # one library call: the GIL is released for all the rows
            self._compute_parallel(handles, masks, ok)
        else:
            for j, handle in enumerate(handles):
                try:
                    handle.unsafe_compute_mask_ptr(masks[j].ctypes.data, self.words * 4)
                except Exception:  # the step's fill computes it again and meets the error there
                    ok[j] = False
        start = 0
        for ticket in todo:
            end = start + len(ticket.handles)
            ticket.masks, ticket.ok = masks[start:end], ok[start:end]
            start = end
        self.calls += 1
        self.rows += n
        self.forced += int(np.count_nonzero((np.bitwise_count(masks.view(np.uint32)).sum(axis=1) == 1) & ok))

    def _compute_parallel(self, handles: list[Any], masks: np.ndarray, ok: np.ndarray) -> None:
        if self._executor is None:
            import llguidance  # not llguidance.torch: importing it compiles a kernel (seconds)

            self._executor = llguidance.LLExecutor(num_threads=self.threads)
        try:
            self._executor.unsafe_compute_mask_ptr([(h, j) for j, h in enumerate(handles)], masks.ctypes.data,
                                                   self.words * 4, len(handles))
        except Exception:
            ok[:] = False
