"""The grammar bitmask of one step: each constrained row's mask (computed ahead on the
mask worker, :mod:`.prefetch`, or here when it was not) copied into one tensor for the
sampler, on the device in one copy.

A step's mask needs every earlier token of its constrained rows accepted by their
matchers: the batch core schedules a constrained row when none of its tokens is in
flight (:func:`omni_async.core.request.mask_ready`), or, in a step of one forward per row,
with the step in flight's token (:func:`omni_async.core.multi_step.late_mask_rows`): that
step's launch enqueues the forward only, and the fill runs when the runner samples it
(``ModelRunner.sample_pending``), once the host has processed the step before. A row
whose request ended or was retracted meanwhile keeps every bit (its token is discarded).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from . import xgrammar_backend
from .prefetch import PARALLEL_MIN_ROWS, all_llguidance, pool_threads

_EXECUTOR: Any = None

# xgrammar's threads for one call's rows (:func:`compute_rows`: the masks between a step's
# forwards, and rows the worker had not computed), from :data:`XGRAMMAR_MIN_ROWS` rows. Its
# masks of one schema overlap (no shared lock, unlike llguidance's); on the 2-core VM two
# threads lost to one (tools/grammar_libraries.py), the GPU host's 16 cores are unmeasured.
XGRAMMAR_THREADS = 1
XGRAMMAR_MIN_ROWS = 64


class GrammarMasks:
    """A runner's mask fills, counted for ``info()``: steps with a constrained row, rows
    masked, host seconds the launching thread spent on them (waiting for the worker,
    copying, computing the rows it had not) and the rows it computed itself; the steps
    sampled under late masks (their forward launched before the step before them was
    processed) and the seconds their fills took (on CUDA the loop thread's: whether the
    masks were ready when the forward was enqueued); with the mask worker's own counters
    (:class:`.prefetch.MaskWorker`)."""

    def __init__(self) -> None:
        self.steps = 0
        self.rows = 0
        self.seconds = 0.0
        self.inline_rows = 0
        self.fused_steps = 0  # fills of multi-step launches (free rows beside), and their seconds
        self.fused_seconds = 0.0
        self.late_steps = 0
        self.late_seconds = 0.0
        # Masks between a step's forwards (.between): forwards after a step's first that
        # sampled under them, their masked rows, the rows computed here and the seconds.
        self.between_forwards = 0
        self.between_rows = 0
        self.between_inline_rows = 0
        self.between_seconds = 0.0
        # A mask the caller computed for the next fill (.between: a forward after the first).
        self.given: torch.Tensor | None = None
        self._worker: Any = None  # the mask worker the filled rows' matchers use

    def fill(self, batch: Any, vocab: int, device: torch.device, fused: bool = False) -> torch.Tensor | None:
        """The step's bitmask (None without a constrained row); ``fused``: a multi-step
        launch, whose free rows wait for it too (counted apart: what masks cost them).
        A mask ``given`` for this fill is taken instead (once)."""
        if self.given is not None:
            mask, self.given = self.given, None
            return mask
        t0 = time.perf_counter()
        rows = grammar_rows(batch)
        if not rows:
            return None
        late = getattr(batch, "late_masks", False)
        words = (vocab + 31) // 32
        # Pinned for a device: the copy below then does not wait (the caching host
        # allocator keeps the buffer until the copy is done).
        bitmask = torch.full((len(batch.reqs), words), -1, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.inline_rows += fill_rows(rows, bitmask)
        if self._worker is None:
            self._worker = getattr(rows[0][0], "_worker", None)
        mask = bitmask.to(device, non_blocking=True) if device.type != "cpu" else bitmask
        self.steps += 1
        self.rows += len(rows)
        took = time.perf_counter() - t0
        self.seconds += took
        if fused:
            self.fused_steps += 1
            self.fused_seconds += took
        if late:
            self.late_steps += 1
            self.late_seconds += took
        return mask

    def count_between(self, rows: int, inline: int, seconds: float) -> None:
        """One forward's masks computed between forwards (:mod:`.between`)."""
        self.between_forwards += 1
        self.between_rows += rows
        self.between_inline_rows += inline
        self.between_seconds += seconds

    def stats(self) -> dict[str, float]:
        out = {"grammar_mask_steps": self.steps, "grammar_mask_rows": self.rows, "grammar_mask_s": self.seconds,
               "grammar_mask_inline_rows": self.inline_rows,
               "grammar_mask_fused_steps": self.fused_steps, "grammar_mask_fused_s": self.fused_seconds,
               "grammar_late_mask_steps": self.late_steps, "grammar_late_mask_s": self.late_seconds,
               "grammar_between_forwards": self.between_forwards, "grammar_between_rows": self.between_rows,
               "grammar_between_inline_rows": self.between_inline_rows, "grammar_between_s": self.between_seconds}
        worker = self._worker
        out.update(worker.stats() if worker is not None else
                   {"grammar_mask_prefetched_rows": 0, "grammar_mask_worker_s": 0.0, "grammar_mask_worker_calls": 0,
                    "grammar_mask_threads": pool_threads(), "grammar_forced_masks": 0, "grammar_jumps": 0,
                    "grammar_forced_skipped": 0, "grammar_optimistic_tokens": 0, "grammar_optimistic_refused": 0})
        return out


def grammar_rows(batch: Any) -> list[tuple[Any, int]]:
    """``(matcher, row)`` of each live row of the step that samples under a grammar's
    mask: not one that samples first (:mod:`.optimistic`: its generation index is past
    ``masked_until``), nor one whose request ended or was retracted since the step was
    scheduled (under late masks the step before was processed in between), whose
    matcher may have completed or failed and whose token is discarded."""
    kept = getattr(batch, "samples_kept", None)
    epochs, indices = batch.epochs, getattr(batch, "sample_indices", None)
    return [
        (m, i)
        for i, r in enumerate(batch.reqs)
        if (m := getattr(r, "matcher", None)) is not None and (kept is None or kept[i]) and r.finish_reason is None
        and r.epoch == epochs[i] and (not indices or indices[i] < m.masked_until)
    ]


def grammar_bitmask(batch: Any, vocab: int, device: torch.device) -> torch.Tensor | None:
    """``[B, ceil(vocab/32)]`` int32 on ``device``: each constrained row's allowed tokens,
    every bit set for the others; None when no row of the step samples under a grammar."""
    return GrammarMasks().fill(batch, vocab, device)


def fill_rows(rows: list[tuple[Any, int]], bitmask: torch.Tensor) -> int:
    """Each ``(matcher, row)``'s allowed tokens written into ``bitmask`` (int32,
    contiguous, on the CPU): the worker's mask where it computed one, else computed here
    (one thread, or llguidance's pool for many rows). Returns the rows computed here."""
    words = bitmask.shape[1]
    target = bitmask.numpy()
    rest: list[tuple[Any, int]] = []
    ones: list[int] = []  # rows whose next token a known forced run gives, and the tokens
    tokens: list[int] = []
    for matcher, row in rows:
        one = matcher.one_token() if hasattr(matcher, "one_token") else None
        if one is not None:
            ones.append(row)
            tokens.append(one)
            continue
        ahead = matcher.next_mask()
        if ahead is not None and ahead.shape[0] == words:
            target[row] = ahead
        else:
            rest.append((matcher.handle, row))
    if ones:  # their one bits in three numpy calls, not a buffer filled and copied per row
        at, tok = np.asarray(ones), np.asarray(tokens, dtype=np.int64)
        target[at] = 0
        target.view(np.uint32)[at, tok >> 5] = np.left_shift(1, tok & 31).astype(np.uint32)
    if rest:
        compute_rows(rest, bitmask)
    return len(rest)


def compute_rows(rows: list[tuple[Any, int]], bitmask: torch.Tensor) -> None:
    """Each ``(library matcher, row)``'s mask computed straight into ``bitmask``."""
    stride = bitmask.shape[1] * 4
    handles = [h for h, _ in rows]
    if xgrammar_backend.all_xgrammar(handles):
        try:  # one xgrammar call; on an error, row by row below, which meets it
            threads = XGRAMMAR_THREADS if len(rows) >= XGRAMMAR_MIN_ROWS else 1
            xgrammar_backend.fill_masks(handles, bitmask.numpy(), [row for _, row in rows], threads)
            return
        except Exception:
            pass
    threads = pool_threads()  # llguidance's pool only where it pays (see .prefetch)
    if len(rows) >= PARALLEL_MIN_ROWS and threads and all_llguidance(handles):
        global _EXECUTOR
        if _EXECUTOR is None:
            import llguidance  # not llguidance.torch: importing it compiles a kernel (seconds)

            _EXECUTOR = llguidance.LLExecutor(num_threads=threads)
        _EXECUTOR.unsafe_compute_mask_ptr(rows, bitmask.data_ptr(), stride, bitmask.shape[0])
        return
    base = bitmask.data_ptr()
    for matcher, row in rows:
        matcher.unsafe_compute_mask_ptr(base + row * stride, stride)
