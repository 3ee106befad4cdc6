"""The cyclic garbage collector while serving (``SchedulerConfig.gc_freeze``).

A full (generation 2) pass of Python's cyclic GC walks every container object alive,
and after torch and a model are loaded that is hundreds of thousands of objects: each
such pass stops the event loop (measured by ``bench/host_overhead.py``: 90-160 ms per
pass on the CPU harness, two passes per 256-request run). Serving allocates enough
short-lived containers per token to trigger full passes regularly. Freezing the heap
once the model is built moves everything alive then into the permanent generation,
which no pass scans, so later full passes cover only what serving itself made.
"""

from __future__ import annotations

import gc


def freeze_heap() -> int:
    """Collect, then freeze every object alive now; returns how many are frozen.
    Process-wide and cumulative (``gc.unfreeze()`` undoes it)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
