"""Grammar masks computed ahead, on a thread of their own, while the loop does other work.

A constrained row's next mask depends only on the tokens its matcher has accepted, so it
can be computed as soon as the host has processed the row's last token, long before the
step that samples under it is launched. Each matcher hands itself to this worker when it
accepts a token (and once when its request is admitted); the worker computes the mask
into the matcher's own buffer, and the step's fill only copies it (waiting when it is not
done yet). llguidance releases the GIL while it computes, so the loop (and, on CUDA, the
launch feeding the device) runs meanwhile.

Matchers are queued, not submitted one by one: the worker takes every matcher queued
since it last looked, so the rows of one processed step are computed together, across
llguidance's thread pool when there are many and cores to spare.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Protocol

import numpy as np

# The same thresholds as the step's own fill (see batch_mask.PARALLEL_MIN_ROWS).
PARALLEL_MIN_ROWS = 16
PARALLEL_MIN_CPUS = 8


class Prefetchable(Protocol):
    def _prefetched(self, buf: np.ndarray | None) -> None: ...


class MaskWorker:
    """One daemon thread computing queued matchers' next masks (``words`` int32 each)."""

    def __init__(self, words: int) -> None:
        self.words = words
        self._cond = threading.Condition(threading.Lock())
        self._queue: list[tuple[Any, np.ndarray, Any]] = []  # (library matcher, target buffer, owner)
        self._thread: threading.Thread | None = None
        self._closed = False
        self._executor: Any = None
        self._staging = np.empty((0, words), dtype=np.int32)
        # Counters for info(): masks computed here, their seconds, and the forced ones
        # (exactly one token admissible: a forward the grammar decided alone).
        self.rows = 0
        self.seconds = 0.0
        self.forced = 0
        # Jump-forwards (structured.jump, on the loop thread): runs and the tokens they skipped.
        self.jumps = 0
        self.jumped = 0
        self.forced_inline = 0  # forced masks a jump-forward computed on the loop thread

    def submit(self, handle: Any, buf: np.ndarray, owner: Prefetchable) -> bool:
        """Queue ``handle``'s next mask into ``buf``; ``owner._prefetched(buf)`` is called
        on the worker when it is there (None when it failed). False once closed."""
        with self._cond:
            if self._closed:
                return False
            self._queue.append((handle, buf, owner))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="omni-grammar-masks", daemon=True)
                self._thread.start()
            self._cond.notify()
        return True

    def close(self) -> None:
        """Stop taking work; what is queued is still computed (its owners wait on it)."""
        with self._cond:
            self._closed = True
            self._cond.notify()

    def stats(self) -> dict[str, float]:
        return {"grammar_mask_prefetched_rows": self.rows, "grammar_mask_worker_s": self.seconds,
                "grammar_forced_masks": self.forced + self.forced_inline, "grammar_jumps": self.jumps,
                "grammar_forced_skipped": self.jumped}

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
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                todo, self._queue = self._queue, []
            t0 = time.perf_counter()
            try:
                self._compute(todo)
            except BaseException:  # never leave an owner waiting: the fill computes those rows itself
                for _, _, owner in todo:
                    owner._prefetched(None)
            self.seconds += time.perf_counter() - t0
            self.rows += len(todo)

    def _compute(self, todo: list[tuple[Any, np.ndarray, Any]]) -> None:
        if len(todo) >= PARALLEL_MIN_ROWS and (os.cpu_count() or 1) >= PARALLEL_MIN_CPUS:
            self._compute_parallel(todo)
            return
        for handle, buf, owner in todo:
            try:
                handle.unsafe_compute_mask_ptr(buf.ctypes.data, buf.nbytes)
            except Exception:  # the step's fill computes it again and meets the error there
                owner._prefetched(None)
                continue
            self._count_forced(buf)
            owner._prefetched(buf)

    def _compute_parallel(self, todo: list[tuple[Any, np.ndarray, Any]]) -> None:
        """Many rows: llguidance's pool fills a staging array, copied row by row after."""
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
        n = len(todo)
        if self._staging.shape[0] < n:
            self._staging = np.empty((n, self.words), dtype=np.int32)
        staging = self._staging
        try:
            self._executor.unsafe_compute_mask_ptr([(h, j) for j, (h, _, _) in enumerate(todo)], staging.ctypes.data,
                                                   self.words * 4, n)
        except Exception:
            for _, _, owner in todo:
                owner._prefetched(None)
            return
        for j, (_, buf, owner) in enumerate(todo):
            buf[:] = staging[j]
            self._count_forced(buf)
            owner._prefetched(buf)

    def _count_forced(self, buf: np.ndarray) -> None:
        if int(np.bitwise_count(buf.view(np.uint32)).sum()) == 1:
            self.forced += 1
