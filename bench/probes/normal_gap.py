"""The normal loop's gap between two decode steps, by phase (issue 42).

``bench/host_overhead.py``'s null device with a modelled device (``--device-us`` a forward):
NV256's shape, the normal loop, ``--decode-steps`` forwards a step. The probe wraps the loop
thread's pieces of a step (the completion await, the runner's collect, the stage's processing
and the core's ``process_result`` inside it, the head of an iteration, scheduling, the launch,
the deferred delivery) with ``time.perf_counter`` ranges, and takes each gap of the modelled
device (from when it finished a decode step to when the next step's work was queued) apart by
the ranges that overlap it. ``wake`` is the part of the completion await after the device was
done; ``other`` what no range covers (the loop's own code between them, asyncio). Only gaps
after decode steps of ``--min-rows`` rows or more and followed by a decode step are counted.

    python bench/probes/normal_gap.py --device-us 1400 --decode-steps 8 --repeats 3
    python bench/probes/normal_gap.py --smoke

Prints a table (median per gap, ms) and saves ``bench/results/normal_gap_<label>.json``.
Imports ``omni_async`` from ``--code`` (default: this checkout).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BENCH))

PHASES = ("wake", "collect", "process_result", "emission", "head", "schedule", "launch", "deliver")


class Ranges:
    """Named (start, end) ranges on the loop thread and the modelled device's events."""

    def __init__(self) -> None:
        self.ranges: list[tuple[str, float, float]] = []
        self.events: list[tuple[float, float, bool, int]] = []  # (queued at, done at, decode, rows)

    def wrap(self, obj, name: str, label: str) -> None:
        inner = getattr(obj, name)
        add = self.ranges.append
        clock = time.perf_counter

        def timed(*a, **kw):
            t0 = clock()
            try:
                return inner(*a, **kw)
            finally:
                add((label, t0, clock()))

        setattr(obj, name, timed)

    def wrap_async(self, obj, name: str, label: str) -> None:
        inner = getattr(obj, name)
        add = self.ranges.append
        clock = time.perf_counter

        async def timed(*a, **kw):
            t0 = clock()
            try:
                return await inner(*a, **kw)
            finally:
                add((label, t0, clock()))

        setattr(obj, name, timed)


def instrument(engine, rec: Ranges) -> None:
    sched = engine.scheduler
    st, runner, em = sched.stepper, sched.runner, sched.emission
    rec.wrap_async(st.executor, "completion", "completion")
    rec.wrap(runner, "collect", "collect")
    rec.wrap(em, "on_step_output", "on_step_output")
    rec.wrap(sched.core, "process_result", "process_result")
    rec.wrap_async(sched, "begin_iteration", "head")
    rec.wrap(st, "next_batch", "schedule")
    if hasattr(sched.core, "schedule_early"):  # the early launch's scheduling, where it exists
        rec.wrap(sched.core, "schedule_early", "schedule")
    rec.wrap(st.executor, "launch", "launch")
    rec.wrap(em, "deliver", "deliver")
    make_event = runner.record_completion
    current = {"rows": 0, "decode": True}
    inner_launch = runner.launch

    def launch(sched_output, *a, **kw):
        batch = sched_output.batch_data
        current["rows"], current["decode"] = batch.size, batch.is_decode
        return inner_launch(sched_output, *a, **kw)

    def record():
        ev = make_event()
        rec.events.append((time.perf_counter(), ev.done_at, current["decode"], current["rows"]))
        return ev

    runner.launch = launch
    runner.record_completion = record


def overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def split_gaps(rec: Ranges, min_rows: int) -> list[dict]:
    """Each device gap after a decode step of ``min_rows``+ rows that a decode step ends,
    split over the ranges overlapping it (seconds)."""
    out = []
    evs = rec.events
    for (q0, done, dec0, rows0), (q1, _, dec1, _) in zip(evs, evs[1:]):
        if not (dec0 and dec1 and rows0 >= min_rows) or q1 <= done:
            continue
        gap = {"gap": q1 - done, "rows": rows0}
        for label, t0, t1 in rec.ranges:
            if t1 > done and t0 < q1:
                gap[label] = gap.get(label, 0.0) + overlap(done, q1, t0, t1)
        gap["wake"] = gap.get("completion", 0.0)  # the completion await's part after the device was done
        gap["emission"] = gap.get("on_step_output", 0.0) - gap.get("process_result", 0.0)
        gap["other"] = gap["gap"] - sum(gap.get(p, 0.0) for p in PHASES)
        out.append(gap)
    return out


async def run(args) -> dict:
    import torch

    torch.set_num_threads(1)
    import host_overhead as ho

    eng = ho.make_engine("normal", args.max_running, args.device_us * 1e-6, args.decode_steps, True, 1024 + 1024,
                         args.prefill_us_per_token * 1e-6)
    await eng.start()
    await ho.run_workload(eng, ho.workload(64, seed=9, vocab=250), 16)
    reqs, new = ho.nv_workload(args.requests, args.requests, 250, (args.nv_lo, args.nv_hi))
    ho.apply_gc_mode("tuned")
    rec = Ranges()
    instrument(eng, rec)
    runs = []
    for _ in range(args.repeats):
        rec.ranges.clear()
        rec.events.clear()
        r, _ = await ho.run_workload(eng, reqs, new)
        gaps = split_gaps(rec, args.min_rows)
        cols = ("gap", *PHASES, "other")
        runs.append({"run": {k: r[k] for k in ("us_per_token", "device_busy", "decode_steps", "device_idle_after_decode_ms")},
                     "gaps": len(gaps),
                     "median_ms": {k: 1e3 * statistics.median(g.get(k, 0.0) for g in gaps) for k in cols} if gaps else {},
                     "mean_ms": {k: 1e3 * statistics.fmean(g.get(k, 0.0) for g in gaps) for k in cols} if gaps else {}})
    ho.apply_gc_mode("default")
    await eng.aclose()
    return {"runs": runs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-running", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--device-us", type=float, default=1400.0)
    ap.add_argument("--prefill-us-per-token", type=float, default=2.0)
    ap.add_argument("--nv-lo", type=int, default=100)
    ap.add_argument("--nv-hi", type=int, default=1024)
    ap.add_argument("--min-rows", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--code", default=str(BENCH.parent))
    ap.add_argument("--label", default="")
    ap.add_argument("--smoke", action="store_true", help="a short run (64 requests, 40-120 new tokens, one repeat)")
    args = ap.parse_args()
    if args.smoke:
        args.requests, args.nv_lo, args.nv_hi, args.repeats, args.min_rows = 64, 40, 120, 1, 16
    sys.path.insert(0, str(Path(args.code).resolve()))
    import _common

    import omni_async

    result = _common.run_async(run(args))
    result.update(config=vars(args), package=str(Path(omni_async.__file__).parent), machine=_common.machine_facts())
    cols = ("gap", *PHASES, "other")
    print(f"{'repeat':>6} {'gaps':>5} " + " ".join(f"{c:>14}" for c in cols) + "   (median ms per gap)")
    for i, r in enumerate(result["runs"]):
        print(f"{i:>6} {r['gaps']:>5} " + " ".join(f"{r['median_ms'].get(c, 0.0):>14.3f}" for c in cols)
              + f"   busy {r['run']['device_busy']:.3f} us/token {r['run']['us_per_token']:.2f}")
    name = f"normal_gap{'_' + args.label if args.label else ''}{'_smoke' if args.smoke else ''}.json"
    print("saved", _common.save_json(name, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
