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
``mask_threads``). ``OMNI_ASYNC_GRAMMAR_THREADS`` can split a ticket's rows (those of every
ticket queued together) over threads of the worker's own (:class:`SlicePool`,
``grammar_mask_slices`` in ``info()``), or hand them to llguidance's pool in one call that
holds no GIL for any of its rows (``grammar_mask_threads``; ``submit`` then hands the
ticket over to the worker, see there).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np

from . import xgrammar_backend

# llguidance's pool, where asked for: a fill computing rows itself (batch_mask.compute_rows)
# uses it from PARALLEL_MIN_ROWS rows.
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


def mask_threads(cpus: int | None = None) -> tuple[str, int]:
    """How the mask worker computes a ticket's rows, from ``OMNI_ASYNC_GRAMMAR_THREADS``:
    ``("one", 1)`` (unset, below 2, or not understood: the default), ``("slices", N)`` for
    ``N`` or ``slices:N`` (N threads of the worker's own, each taking every N-th row; at
    most ``cpus``, the host's by default), ``("pool", N)`` for ``pool:N`` (llguidance's pool
    of N threads, one call a ticket; at most every CPU but one, as before).

    Why slices replace the pool behind the plain number: the pool lost to one thread on
    every host measured (H200 host, tools/grammar_batch.py: 128 rows 5.8 ms on one
    thread, 7.8 with a pool of 4, 10.4 with 15, bench/results/h200_2026-12-04_evening/gb_t*;
    this VM: a pool of ONE thread 4.1 ms against 2.7 for the plain loop at 256 rows, so its
    cost is per row, not only thread scaling); a slice is the worker's own
    loop, so a row the library refuses fails that row alone (a pool call that raises fails
    the ticket), and it needs no hand-over wait in ``submit``. ``pool:N`` keeps the pool
    reachable for comparison. Slices may use every CPU: where they pay (the masks bound the
    step), the loop thread is waiting for them at the fill.

    Why off by default: no host measured shows a gain. And for the usual case, every
    request under one schema, the library's own work cannot overlap on any host:
    llguidance's copies of one compiled grammar share the grammar's lexer (its lazily built
    automaton) behind one mutex, held for a whole mask computation (``Parser::with_shared``
    in llguidance's earley/parser.rs; a matcher's ``deep_copy`` clones the handle to it),
    and the engine gives every request with one grammar a copy of one template
    (``structured.grammar``), so the pool's threads and the slices alike compute the rows
    of one schema one at a time. What slices may still overlap: rows of different
    grammars (on the 2-core VM two slices made the worker 1.4x slower, median of four
    interleaved pairs, 0.91-1.55x, on a loaded CPU). The worker's time per row in the
    engine is not GIL waits: it is the library's price for a mask at a parser state not
    computed before, ~3.5x a repeated one (``7166a36:bench/probes/mask_cost.py``). The H200 runs are in
    bench/RESULTS.md (``tools/mask_threads.py --compilers 1,8``;
    ``bench/constrained.py --mask-threads 8 [--schemas 8]``)."""
    raw = os.environ.get("OMNI_ASYNC_GRAMMAR_THREADS", "").strip().lower()
    way, _, count = raw.rpartition(":")
    try:
        asked = int(count)
    except ValueError:
        return ("one", 1)
    if asked < 2 or way not in ("", "slices", "pool"):
        return ("one", 1)
    cpus = host_cpus() if cpus is None else cpus
    if way == "pool":
        return ("pool", min(asked, max(1, cpus - 1)))
    return ("slices", min(asked, max(1, cpus))) if cpus >= 2 else ("one", 1)


def pool_threads(cpus: int | None = None) -> int:
    """llguidance's pool (``OMNI_ASYNC_GRAMMAR_THREADS=pool:N``, see :func:`mask_threads`):
    its threads, or 0 (no pool)."""
    way, n = mask_threads(cpus)
    return n if way == "pool" else 0


def all_llguidance(handles: Any) -> bool:
    """Whether every handle is llguidance's own matcher: only those go to llguidance's
    pool (a grammar xgrammar compiled, :mod:`.xgrammar_backend`, is computed row by row)."""
    return not any(isinstance(h, xgrammar_backend.XGrammarHandle) for h in handles)


def compute_slice(handles: list[Any], masks: np.ndarray, ok: np.ndarray, first: int, step: int,
                  runs: list[Any] | None = None) -> None:
    """Rows ``first, first + step, ...`` of ``handles`` into ``masks`` (C-contiguous int32);
    a row the library refuses is marked in ``ok`` (the step's fill computes it again and
    meets the error there) and the others carry on.

    Given ``runs`` (one entry per row), each row first asks the library for the tokens its
    grammar forces from here (``compute_ff_tokens``, from the parser state): where there
    are some, the first is the one admissible token, its mask is that one bit (no mask
    computed) and ``runs[j]`` keeps the run, so the matcher knows the masks of the run's
    next positions without the library (:meth:`.grammar.GrammarMatcher.accept`). Why: 72%
    of a JSON schema's positions admit one token, most of them inside runs of several
    (``{"``, ``name``, ``":``), and a mask at a new parser state costs the library ~20-40
    us (7166a36:bench/probes/mask_cost.py); one forced-token query covers the whole run."""
    stride = masks.shape[1] * 4
    base = masks.ctypes.data
    bits = masks.view(np.uint32)
    for j in range(first, len(handles), step):
        try:
            if runs is not None:
                run = handles[j].compute_ff_tokens()
                if run:
                    t = run[0]
                    bits[j] = 0
                    bits[j, t >> 5] = 1 << (t & 31)
                    runs[j] = run
                    continue
            handles[j].unsafe_compute_mask_ptr(base + j * stride, stride)
        except Exception:
            ok[j] = False


class SlicePool:
    """``threads - 1`` helper threads that, with the calling thread, compute one job's rows:
    thread i takes rows i, i + k, ... (k = min(threads, rows)). Started on the first job and
    woken per job (a start per ticket would cost a thread creation a step); ``run`` returns
    once every slice is done, so each matcher is touched by one thread, and only while its
    owner waits on the ticket. Each row's library call releases the GIL."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._cond = threading.Condition(threading.Lock())
        self._job: tuple[list[Any], np.ndarray, np.ndarray, int, list[Any] | None] | None = None
        self._generation = 0
        self._left = 0  # helpers still computing the current job
        self._stopped = False
        self._helpers: list[threading.Thread] = []
        self.jobs = 0  # jobs split over two threads or more (info(): grammar_mask_sliced_calls)

    def run(self, handles: list[Any], masks: np.ndarray, ok: np.ndarray, runs: list[Any] | None = None) -> None:
        """Every row of ``handles`` into ``masks`` (marking refused rows in ``ok``; forced
        runs into ``runs``, see :func:`compute_slice`)."""
        k = min(self.threads, len(handles))
        if k < 2 or self._stopped:
            compute_slice(handles, masks, ok, 0, 1, runs)
            return
        if not self._helpers:
            self._helpers = [threading.Thread(target=self._helper, args=(i,), name=f"omni-grammar-slice-{i}",
                                              daemon=True) for i in range(1, self.threads)]
            for t in self._helpers:
                t.start()
        self.jobs += 1
        with self._cond:
            self._job, self._left = (handles, masks, ok, k, runs), k - 1
            self._generation += 1
            self._cond.notify_all()
        try:
            compute_slice(handles, masks, ok, 0, k, runs)
        finally:  # the helpers' rows are theirs until they are done: wait for them even on an error here
            with self._cond:
                self._cond.wait_for(lambda: self._left == 0)
                self._job = None

    def close(self) -> None:
        """Let the helpers end (after their current slice)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def _helper(self, i: int) -> None:
        seen = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopped or (self._job is not None and self._generation != seen))
                if self._job is None or self._generation == seen:  # stopped, nothing new to do
                    return
                seen = self._generation
                handles, masks, ok, k, runs = self._job
            if i >= k:  # a job of fewer rows than threads: not counted in _left
                continue
            try:
                compute_slice(handles, masks, ok, i, k, runs)
            finally:
                with self._cond:
                    self._left -= 1
                    if self._left == 0:
                        self._cond.notify_all()


class MaskTicket:
    """The next masks of matchers queued together: ``masks[j]`` (``[words]`` int32) is
    the j-th handle's once ``done`` is set and ``ok[j]`` is true (false: the library
    refused; the fill computes that row itself and meets the error there); ``runs[j]``:
    the tokens its grammar forces from there, where it forces some (else None; no runs
    at all from llguidance's pool)."""

    __slots__ = ("handles", "masks", "ok", "runs", "done")

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles
        self.masks: np.ndarray | None = None
        self.ok: np.ndarray | None = None
        self.runs: list[Any] | None = None
        self.done = threading.Event()

    def mask(self, j: int) -> np.ndarray | None:
        """Row ``j``'s mask (waiting for the worker while it computes), or None."""
        if not self.done.is_set():
            self.done.wait()
        ok = self.ok
        return self.masks[j] if ok is not None and ok[j] and self.masks is not None else None

    def run(self, j: int) -> Any:
        """Row ``j``'s forced tokens (the first is its mask's one token), or None: not
        forced, or not known (call after :meth:`mask`)."""
        runs, ok = self.runs, self.ok
        return runs[j] if runs is not None and ok is not None and ok[j] else None


class MaskWorker:
    """One daemon thread computing queued tickets' masks (``words`` int32 each), alone or
    with its slice helpers (:func:`mask_threads`)."""

    def __init__(self, words: int) -> None:
        self.words = words
        self._cond = threading.Condition(threading.Lock())
        self._queue: list[MaskTicket] = []
        self._thread: threading.Thread | None = None
        self._closed = False
        self._idle = False  # the worker waits for work (a submit then hands its ticket over)
        self._executor: Any = None
        way, n = mask_threads()
        self.threads = n if way == "pool" else 0  # llguidance's pool (0: none)
        self.slices = SlicePool(n) if way == "slices" else None  # the worker's own threads (None: one)
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
        self.forced_known = 0  # forced masks known from a run found earlier: no library call at all
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
                "grammar_mask_slices": self.slices.threads if self.slices is not None else 0,
                "grammar_mask_sliced_calls": self.slices.jobs if self.slices is not None else 0,
                "grammar_forced_masks": self.forced + self.forced_inline + self.forced_known,
                "grammar_forced_from_runs": self.forced_known, "grammar_jumps": self.jumps,
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
                    if self.slices is not None:
                        self.slices.close()
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
        """Every queued ticket's rows in one array (by llguidance's pool, the worker's
        slice threads, or a loop here: :func:`mask_threads`), then each ticket given its
        part."""
        handles = [h for ticket in todo for h in ticket.handles]
        n = len(handles)
        masks = np.empty((n, self.words), dtype=np.int32)
        ok = np.ones(n, dtype=bool)
        runs: list[Any] | None = [None] * n
        if self.threads and n > 1 and all_llguidance(handles):  # one library call: the GIL is released for all the rows
            runs = None
            self._compute_parallel(handles, masks, ok)
        elif xgrammar_backend.all_xgrammar(handles):  # one xgrammar call (no forced runs from it)
            try:
                xgrammar_backend.fill_masks(handles, masks, threads=self.slices.threads if self.slices is not None else 1)
            except Exception:
                ok[:] = False  # the fill computes them row by row and meets the error there
        elif self.slices is not None:  # every queued ticket's rows, over the worker's threads
            self.slices.run(handles, masks, ok, runs)
        else:
            compute_slice(handles, masks, ok, 0, 1, runs)
        start = 0
        for ticket in todo:
            end = start + len(ticket.handles)
            ticket.masks, ticket.ok = masks[start:end], ok[start:end]
            ticket.runs = runs[start:end] if runs is not None else None
            start = end
        self.calls += 1
        self.rows += n
        if runs is None:
            self.forced += int(np.count_nonzero((np.bitwise_count(masks.view(np.uint32)).sum(axis=1) == 1) & ok))
        else:  # a run's first token is its row's one admissible token
            self.forced += sum(1 for j, run in enumerate(runs) if run and ok[j])

    def _compute_parallel(self, handles: list[Any], masks: np.ndarray, ok: np.ndarray) -> None:
        if self._executor is None:
            import llguidance  # not llguidance.torch: importing it compiles a kernel (seconds)

            self._executor = llguidance.LLExecutor(num_threads=self.threads)
        try:
            self._executor.unsafe_compute_mask_ptr([(h, j) for j, h in enumerate(handles)], masks.ctypes.data,
                                                   self.words * 4, len(handles))
        except Exception:
            ok[:] = False
