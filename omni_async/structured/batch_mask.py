"""The grammar bitmask of one step: filled on the host from each constrained row's
matcher, then copied to the device in one tensor for the sampler.

A step's mask needs every earlier token of its constrained rows accepted by their
matchers, so such a step is never launched ahead of the previous step's results (see
:func:`has_constrained_rows`, checked by the stepper, and the multi-step scheduler, which
runs these batches one forward per step).
"""

from __future__ import annotations

from typing import Any

import torch

_EXECUTOR: Any = None


def has_constrained_rows(batch: Any) -> bool:
    return any(getattr(r, "grammar", None) is not None for r in batch.reqs)


def grammar_bitmask(batch: Any, vocab: int, device: torch.device) -> torch.Tensor | None:
    """``[B, ceil(vocab/32)]`` int32 on ``device``: each constrained row's allowed tokens,
    every bit set for the others; None when no row of the step samples under a grammar."""
    kept = getattr(batch, "samples_kept", None)
    rows = [
        (r.grammar.handle, i)
        for i, r in enumerate(batch.reqs)
        if getattr(r, "grammar", None) is not None and (kept is None or kept[i])
    ]
    if not rows:
        return None
    global _EXECUTOR
    if _EXECUTOR is None:
        import llguidance  # not llguidance.torch: importing it compiles a kernel (seconds)

        _EXECUTOR = llguidance.LLExecutor()
    words = (vocab + 31) // 32
    bitmask = torch.full((len(batch.reqs), words), -1, dtype=torch.int32)
    # The rows' masks in parallel, written straight into ``bitmask`` (contiguous, CPU).
    _EXECUTOR.unsafe_compute_mask_ptr(rows, bitmask.data_ptr(), words * 4, len(batch.reqs))
    return bitmask.to(device, non_blocking=True) if device.type != "cpu" else bitmask
