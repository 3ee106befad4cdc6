"""The grammar bitmask of one step: filled on the host from each constrained row's
matcher, then copied to the device in one tensor for the sampler.

A step's mask needs every earlier token of its constrained rows accepted by their
matchers, so such a step is never launched ahead of the previous step's results (see
:func:`omni_async.core.request.any_constrained`, checked by the stepper, and the multi-step scheduler, which
runs these batches one forward per step).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

_EXECUTOR: Any = None
# llguidance's thread pool pays a wake-up per fill: on a 2-core host it was 2-20x slower than
# one thread at 4-64 rows (~15 us a row there; bench/probes/grammar_libraries.py measures both).
# It is used only for many rows on a host with cores to spare.
PARALLEL_MIN_ROWS = 16
PARALLEL_MIN_CPUS = 8


class GrammarMasks:
    """A runner's mask fills, counted for ``info()``: steps with a constrained row, rows
    masked and host seconds spent filling (the device application is in the sampler)."""

    def __init__(self) -> None:
        self.steps = 0
        self.rows = 0
        self.seconds = 0.0

    def fill(self, batch: Any, vocab: int, device: torch.device) -> torch.Tensor | None:
        t0 = time.perf_counter()
        mask = grammar_bitmask(batch, vocab, device)
        if mask is not None:
            self.steps += 1
            self.rows += sum(1 for r in batch.reqs if getattr(r, "matcher", None) is not None)
            self.seconds += time.perf_counter() - t0
        return mask

    def stats(self) -> dict[str, float]:
        return {"grammar_mask_steps": self.steps, "grammar_mask_rows": self.rows, "grammar_mask_s": self.seconds}


def grammar_bitmask(batch: Any, vocab: int, device: torch.device) -> torch.Tensor | None:
    """``[B, ceil(vocab/32)]`` int32 on ``device``: each constrained row's allowed tokens,
    every bit set for the others; None when no row of the step samples under a grammar."""
    kept = getattr(batch, "samples_kept", None)
    rows = [
        (r.matcher.handle, i)
        for i, r in enumerate(batch.reqs)
        if getattr(r, "matcher", None) is not None and (kept is None or kept[i])
    ]
    if not rows:
        return None
    words = (vocab + 31) // 32
    bitmask = torch.full((len(batch.reqs), words), -1, dtype=torch.int32)
    fill_rows(rows, bitmask)
    return bitmask.to(device, non_blocking=True) if device.type != "cpu" else bitmask


def fill_rows(rows: list[tuple[Any, int]], bitmask: torch.Tensor) -> None:
    """Each ``(matcher, row)``'s allowed tokens written straight into ``bitmask`` (int32,
    contiguous, on the CPU): one thread, or llguidance's pool for many rows."""
    stride = bitmask.shape[1] * 4
    if len(rows) >= PARALLEL_MIN_ROWS and (os.cpu_count() or 1) >= PARALLEL_MIN_CPUS:
        global _EXECUTOR
        if _EXECUTOR is None:
            import llguidance  # not llguidance.torch: importing it compiles a kernel (seconds)

            _EXECUTOR = llguidance.LLExecutor()
        _EXECUTOR.unsafe_compute_mask_ptr(rows, bitmask.data_ptr(), stride, bitmask.shape[0])
        return
    base = bitmask.data_ptr()
    for matcher, row in rows:
        matcher.unsafe_compute_mask_ptr(base + row * stride, stride)
