"""The cyclic garbage collector while serving (``SchedulerConfig.gc_freeze`` and
``gc_gen0_threshold``).

A full (generation 2) pass of Python's cyclic GC walks every container object alive,
and after torch and a model are loaded that is hundreds of thousands of objects: each
such pass stops the event loop (measured by ``tools/host_overhead.py``: 86-480 ms per
pass on the CPU harness, two passes per 256-request run). Serving allocates enough
short-lived containers per token to trigger full passes regularly. Freezing the heap
once the model is built moves everything alive then into the permanent generation,
which no pass scans, so later full passes cover only what serving itself made.

Young-generation passes are short but frequent: a step's messages and deltas live until
the readers run, so the net allocation count crosses Python's threshold of 700 every
step or two (about 270 passes, ~20 ms, per 256-request run on the CPU harness). A
higher first threshold makes them rare; each pass then walks at most that many objects.
"""

from __future__ import annotations

import gc


def configure_gc(freeze: bool, gen0_threshold: int | None) -> None:
    """Apply the engine's GC options (both process-wide; nothing when neither is set)."""
    if gen0_threshold is not None:
        gc.set_threshold(gen0_threshold, *gc.get_threshold()[1:])
    if freeze:
        freeze_heap()


def freeze_heap() -> int:
    """Collect, then freeze every object alive now; returns how many are frozen.
    Process-wide and cumulative (``gc.unfreeze()`` undoes it)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
