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

On CUDA an engine's build ends with one full pass (without ``gc_freeze``). Python starts a
full pass once the objects promoted to the oldest generation since the last one exceed a
quarter of those it kept, and a build promotes the loader's, the warm-up's and the
captures' objects without reaching that point: the first requests then pay the full pass
the build left, and the next ones do not (``bench/first_run.py --smoke --requests 256``
on the 2-core VM: one full pass of 98-106 ms in each first run, none in each second; a
fresh process's first NV256 run on an H100 had its first token 74-138 ms later than its
second's). Collected at the build, the pass costs the start instead of a request. Not on
the CPU, where a build of the tiny model takes a few tenths of a second and the pass about
a tenth more.
"""

from __future__ import annotations

import gc


def configure_gc(freeze: bool, gen0_threshold: int | None, device: str = "cpu") -> None:
    """Apply the engine's GC options (both process-wide) once its stage is built on
    ``device``; a CUDA build's last act is a full pass (module docstring)."""
    if gen0_threshold is not None:
        gc.set_threshold(gen0_threshold, *gc.get_threshold()[1:])
    if freeze:
        freeze_heap()
    elif str(device).startswith("cuda") and gc.isenabled():
        gc.collect()


def freeze_heap() -> int:
    """Collect, then freeze every object alive now; returns how many are frozen.
    Process-wide and cumulative (``gc.unfreeze()`` undoes it)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
