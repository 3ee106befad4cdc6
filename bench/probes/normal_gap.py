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
    python bench/probes/normal_gap.py --code /work/main --code . --labels main,branch --processes 5 --repeats 3

Prints a table (median per gap, ms) and saves ``bench/results/normal_gap_<label>.json``.
Imports ``omni_async`` from ``--code`` (default: this checkout).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BENCH))

PHASES = ("wake", "collect", "process_result", "emission", "head", "schedule", "launch", "deliver")
# The launch's parts (inside ``launch``, not added to ``other``): the input batch's slots,
# the fused launch's plan and its [B, 5] host array, the stand-in replay (the CUDA path's
# host calls around a graph replay), the slots' newest tokens, the host copy, the event.
LAUNCH_PARTS = ("l_assign", "l_plan", "l_host_array", "l_replay", "l_publish", "l_copy", "l_event")


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
    import omni_async.runners.base as base_mod

    for obj, name, label in ((runner.inputs, "assign", "l_assign"), (runner, "_fused_batch", "l_plan"),
                             (runner.fused_decode, "batch", "l_host_array"), (runner.fused_decode, "run", "l_replay"),
                             (runner.inputs, "publish_steps", "l_publish"), (base_mod, "copy_to_host", "l_copy")):
        if obj is not None and hasattr(obj, name):
            rec.wrap(obj, name, label)
    make_event = runner.record_completion
    current = {"rows": 0, "decode": True}
    inner_launch = runner.launch

    def launch(sched_output, *a, **kw):
        batch = sched_output.batch_data
        current["rows"], current["decode"] = batch.size, batch.is_decode
        return inner_launch(sched_output, *a, **kw)

    def record():
        t0 = time.perf_counter()
        ev = make_event()
        rec.ranges.append(("l_event", t0, time.perf_counter()))
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
        cols = ("gap", *PHASES, "other", *LAUNCH_PARTS)
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
    ap.add_argument("--code", action="append", help="import omni_async from this checkout; twice or more: "
                    "before/after, each in --processes processes per checkout, alternating")
    ap.add_argument("--labels", default="", help="with several --code: their labels")
    ap.add_argument("--processes", type=int, default=5, help="with several --code: processes per checkout")
    ap.add_argument("--child-out", default="", help=argparse.SUPPRESS)
    ap.add_argument("--label", default="")
    ap.add_argument("--smoke", action="store_true", help="a short run (64 requests, 40-120 new tokens, one repeat)")
    args = ap.parse_args()
    if args.smoke:
        args.requests, args.nv_lo, args.nv_hi, args.repeats, args.min_rows = 64, 40, 120, 1, 16
    codes = args.code or [str(BENCH.parent)]
    if len(codes) > 1:
        return compare(args, codes)
    args.code = codes[0]
    sys.path.insert(0, str(Path(args.code).resolve()))
    import _common

    import omni_async

    result = _common.run_async(run(args))
    result.update(config=vars(args), package=str(Path(omni_async.__file__).parent), machine=_common.machine_facts())
    if args.child_out:
        Path(args.child_out).write_text(json.dumps(result))
        return 0
    cols = ("gap", *PHASES, "other", *LAUNCH_PARTS)
    print(f"{'repeat':>6} {'gaps':>5} " + " ".join(f"{c:>8}" for c in cols) + "   (median ms per gap)")
    for i, r in enumerate(result["runs"]):
        print(f"{i:>6} {r['gaps']:>5} " + " ".join(f"{r['median_ms'].get(c, 0.0):>8.3f}" for c in cols)
              + f"   busy {r['run']['device_busy']:.3f} us/token {r['run']['us_per_token']:.2f}")
    name = f"normal_gap{'_' + args.label if args.label else ''}{'_smoke' if args.smoke else ''}.json"
    print("saved", _common.save_json(name, result))
    return 0


def compare(args, codes: list[str]) -> int:
    """Each checkout in ``--processes`` processes, alternating; per checkout the median
    [min-max] over processes of each process's median gap and phases, and per process pair
    the gap's ratio to the first checkout's."""
    import subprocess
    import tempfile

    import _common

    labels = args.labels.split(",") if args.labels else [Path(c).resolve().name for c in codes]
    here = Path(__file__).resolve()
    base, skip = [], False  # this command's arguments less --code and --labels
    for a in sys.argv[1:]:
        if skip or a.startswith(("--code=", "--labels=")):
            skip = False
            continue
        skip = a in ("--code", "--labels", "--label")
        if not skip:
            base.append(a)
    cols = ("gap", *PHASES, "other", *LAUNCH_PARTS)
    per: dict[str, list[dict]] = {label: [] for label in labels}
    for p in range(args.processes):
        for code, label in zip(codes, labels):
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
                out = tmp.name
            cmd = [sys.executable, str(here), *base, "--code", str(Path(code).resolve()), "--child-out", out]
            subprocess.run(cmd, check=True, cwd=str(BENCH.parent), stdout=subprocess.DEVNULL)
            r = json.loads(Path(out).read_text())
            Path(out).unlink()
            med = {c: statistics.median(run["median_ms"].get(c, 0.0) for run in r["runs"]) for c in cols}
            med["busy"] = statistics.median(run["run"]["device_busy"] for run in r["runs"])
            per[label].append(med)
            print(f"process {p} {label:>12}: gap {med['gap']:.3f} launch {med['launch']:.3f} busy {med['busy']:.3f}", flush=True)
    summary: dict = {}
    print(f"{'label':>12} " + " ".join(f"{c:>8}" for c in (*cols, "busy")) + "   (median of the processes' medians, ms per gap)")
    for label in labels:
        summary[label] = {c: {"median": statistics.median(m[c] for m in per[label]), "min": min(m[c] for m in per[label]),
                              "max": max(m[c] for m in per[label])} for c in (*cols, "busy")}
        print(f"{label:>12} " + " ".join(f"{summary[label][c]['median']:>8.3f}" for c in (*cols, "busy")))
    for label in labels[1:]:
        for c in ("gap", "launch", "l_assign", "l_replay"):
            ratios = [b[c] / a[c] for a, b in zip(per[labels[0]], per[label]) if a[c]]
            if ratios:
                summary[f"{label}/{labels[0]}/{c}"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
                print(f"paired {label}/{labels[0]} {c}: {statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]")
    name = f"normal_gap_{args.label or 'ab'}{'_smoke' if args.smoke else ''}.json"
    print("saved", _common.save_json(name, {"config": vars(args), "labels": labels, "codes": codes, "processes": per,
                                            "summary": summary, "machine": _common.machine_facts()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
