"""Where the GPU sits idle in NV256, and what the host was doing then (issue 42).

Per loop: an engine (defaults), one warm NV256 run (graphs and kernels built), one plain run
(tok/s and NVML busy, no profiler), then one run under ``torch.profiler`` (CPU and CUDA
activity, no shapes or stacks) with the stepper's, stage's, runner's and emission's step
functions wrapped from here in ``record_function`` ranges (named ``oa.*``; nothing in
``omni_async`` changes). The ranges are also logged by this probe with their thread, because
the profiler records CPU ranges only on the thread that started it (the loop's): the
prefill launches on the worker thread come from this log, aligned to the profiler's clock
by the loop thread's ranges, which are in both.

Analysis (``gap_analysis.py``): device busy = the union of kernels, copies and sets over the
run (first submission to last token); every idle gap >= ``--min-gap-us`` attributed to the
innermost loop-thread range at its start and end (and split over the ranges during it), to
the run's phase, to the kind of step that ended it; decode steps' device time against
their host time (launch to launch) by rows; prefill steps. Each device op is tied to its
step through the CUDA runtime / driver call that launched it (CUPTI correlation id) and
the launch range that call fell in. With ``--smoke`` (CPU, tiny model) the "device" is the
worker thread's forwards (the CPU runner's launch).

    python tools/gpu_gaps.py [--loops overlap,normal] [--mode sampled[,greedy]]
        [--requests 256] [--out $OUT/gpu_gaps.json] [--trace-dir DIR] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # _common and the benchmarks
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's omni_async

from _common import LOOPS, save_json  # noqa: E402
from gap_analysis import analyse, print_loop, print_summary  # noqa: E402
from nv256 import QWEN05, SMOKE_SHAPE, Workload, facts, free_device, make_checkpoint, run_nv  # noqa: E402

from omni_async import Engine, SamplingParams  # noqa: E402
from omni_async.backends.native.builder import build_off_this_thread  # noqa: E402

DEVICE_OPS = {"kernel", "gpu_memcpy", "gpu_memset"}
LAUNCH_CALLS = {"cuda_runtime", "cuda_driver"}
LAUNCH_SLACK_NS = 20_000
BLOCKING_CALLS = {"cudaMemcpy", "cudaMemset", "cuMemcpyDtoH_v2", "cuMemcpyHtoD_v2"}  # and every *Synchronize
SYNC_RANGES = {  # (object path from the engine, attribute): range name
    ("scheduler.stepper", "next_batch"): "schedule",
    ("scheduler.stepper.core", "schedule_early"): "schedule.early",  # the normal loop's early launch (absent before it)
    ("scheduler.stepper", "_launch_on_worker"): None,  # named by the step's kind (launch_range)
    ("scheduler.stepper.runner", "collect"): "collect",
    ("scheduler.stepper.sink", "on_step_output"): "process",
    ("scheduler.stepper.sink", "deliver"): "deliver",
}
ASYNC_RANGES = {
    ("scheduler", "begin_iteration"): "iteration",
    ("scheduler.intake", "receive_and_admit"): "admit",
    ("scheduler.stepper", "step_ahead"): "step.ahead",
    ("scheduler.stepper", "step_in_sync"): "step.sync",
    ("scheduler.stepper", "_launch"): "step.launch",
    ("scheduler.stepper", "_launched"): "wait.launched",
    ("scheduler.stepper", "_complete"): "complete",
    ("scheduler.stepper.executor", "wait"): "wait.launch_future",
    ("scheduler.stepper.executor", "completion"): "wait.device",
    ("scheduler.stepper.wake", "wait"): "idle",
}


_ABSENT = object()


def log(*a: Any) -> None:
    print(*a, flush=True)


def _owner(eng: Engine, path: str) -> Any:
    obj: Any = eng
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


class RangeLog:
    """The probe's ranges: (start_ns, end_ns, name) per thread on ``perf_counter_ns``, and one
    dict per launched step. Installed on one engine's objects (instance attributes, so nothing
    else is patched); on the loop thread each range is also a ``record_function``."""

    def __init__(self) -> None:
        self.loop_ident = threading.get_ident()
        self.loop: list[tuple[int, int, str]] = []
        self.worker: list[tuple[int, int, str]] = []
        self.steps: list[dict[str, Any]] = []
        self.marks: dict[str, int] = {}
        self.syncs: list[tuple[int, int, str]] = []  # blocking CUDA calls (from the trace, its clock)
        # The profiler's clock is Unix time: the fallback when no range of ours is in its trace.
        self.epoch_offset = time.time_ns() - time.perf_counter_ns()

    def _record(self, name: str, t0: int, t1: int) -> None:
        (self.loop if threading.get_ident() == self.loop_ident else self.worker).append((t0, t1, name))

    def _sync(self, fn: Callable[..., Any], name: str | None) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            step = None if name else self._launch_step(args[0])
            label = name or "launch." + step["kind"]  # type: ignore[index]
            on_loop = threading.get_ident() == self.loop_ident
            rf = torch.autograd.profiler.record_function("oa." + label) if on_loop else None
            if rf is not None:
                rf.__enter__()
            t0 = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                t1 = time.perf_counter_ns()
                if rf is not None:
                    rf.__exit__(None, None, None)
                self._record(label, t0, t1)
                if step is not None:
                    step["launch"] = (t0, t1)
        return wrapped

    def _async(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        async def wrapped(*args: Any, **kwargs: Any) -> Any:
            with torch.autograd.profiler.record_function("oa." + name):
                t0 = time.perf_counter_ns()
                try:
                    return await fn(*args, **kwargs)
                finally:
                    self._record(name, t0, time.perf_counter_ns())
        return wrapped

    def _launch_step(self, sched_output: Any) -> dict[str, Any]:
        batch = sched_output.batch_data
        steps = getattr(batch, "row_steps", None)
        step = {"kind": "decode" if batch.is_decode else "prefill", "rows": batch.size, "k": max(steps) if steps else 1,
                "tokens": sum(getattr(batch, "extend_lens", None) or [batch.size]), "launch": (0, 0)}
        self.steps.append(step)
        return step

    def install(self, eng: Engine, extra: dict[tuple[str, str], str] | None = None) -> None:
        """Wrap the engine's step functions (instance attributes); ``uninstall`` puts them back.
        ``extra``: more synchronous ranges, as :data:`SYNC_RANGES` names them."""
        self._undo: list[tuple[Any, str, Any]] = []
        syncs = {**SYNC_RANGES, **(extra or {})}
        wraps = [(k, self._sync, n) for k, n in syncs.items()] + [(k, self._async, n) for k, n in ASYNC_RANGES.items()]
        for (path, attr), wrap, name in wraps:
            owner = _owner(eng, path)
            if not hasattr(owner, attr):
                continue
            self._undo.append((owner, attr, owner.__dict__.get(attr, _ABSENT)))
            setattr(owner, attr, wrap(getattr(owner, attr), name))
        flush = eng.flush_cache

        async def flushed() -> Any:  # run_nv flushes, then submits: the run starts here
            out = await flush()
            self.marks["submit"] = time.perf_counter_ns()
            return out
        self._undo.append((eng, "flush_cache", eng.__dict__.get("flush_cache", _ABSENT)))
        eng.flush_cache = flushed  # type: ignore[method-assign]

    def uninstall(self) -> None:
        for owner, attr, before in reversed(self._undo):
            if before is _ABSENT:
                delattr(owner, attr)
            else:
                setattr(owner, attr, before)


def activity(ev: Any) -> str:
    """An event's kineto activity type ("kernel", "cuda_runtime", ...). A torch whose events do
    not name it: "device?" for device work or a GPU annotation (told apart by name later),
    "cuda_runtime" for a CPU event named like a CUDA call, "cpu?" for the rest."""
    at = ev.activity_type() if hasattr(ev, "activity_type") else None
    if isinstance(at, str):
        return at
    if ev.device_type() == torch.profiler.DeviceType.CUDA:
        return "device?"
    return "cuda_runtime" if ev.name().startswith("cu") else "cpu?"


def clock_offset(ann: list[tuple[int, str]], mine: list[tuple[int, int, str]]) -> tuple[int, int]:
    """The profiler's clock minus ``perf_counter_ns``: the median over the loop thread's ranges,
    paired in start order by name (a range the profiler has and the log lacks, one still open
    when the profiler stopped, is skipped)."""
    diffs, i = [], 0
    for t, name in ann:
        if i < len(mine) and mine[i][2] == name:
            diffs.append(t - mine[i][0])
            i += 1
    return (int(statistics.median(diffs)) if diffs else 0), len(diffs)


def kineto_view(prof: Any, rl: RangeLog, cuda: bool) -> tuple[list[tuple[int, int, int]], dict[str, Any]]:
    """Device ops tied to steps, and the log's ranges moved onto the profiler's clock."""
    t0 = time.perf_counter()
    ann: list[tuple[int, str]] = []
    launches: dict[int, int] = {}
    raw: list[tuple[int, int, int]] = []
    types: dict[str, int] = {}
    runtime: dict[str, list[int]] = {}  # CUDA runtime / driver call: [count, ns]
    device_named: list[tuple[int, int, int, str]] = []
    cpu_names: set[str] = set()
    for ev in prof.profiler.kineto_results.events():
        at = activity(ev)
        types[at] = types.get(at, 0) + 1
        if at in DEVICE_OPS:
            s = ev.start_ns()
            raw.append((s, s + ev.duration_ns(), ev.correlation_id()))
        elif at == "device?":  # no activity type from this torch: an annotation's mirror is dropped below
            s = ev.start_ns()
            device_named.append((s, s + ev.duration_ns(), ev.correlation_id(), ev.name()))
        elif at in LAUNCH_CALLS:
            s, name = ev.start_ns(), ev.name()
            launches[ev.correlation_id()] = s
            calls = runtime.setdefault(name, [0, 0])
            calls[0] += 1
            calls[1] += ev.duration_ns()
            if "ynchronize" in name or name in BLOCKING_CALLS:
                rl.syncs.append((s, s + ev.duration_ns(), name))
        elif at in ("user_annotation", "cpu?"):
            name = ev.name()
            cpu_names.add(name)
            if name.startswith("oa."):
                ann.append((ev.start_ns(), name[3:]))
    raw += [(s, e, c) for s, e, c, name in device_named if name not in cpu_names]
    offset, pairs = clock_offset(sorted(ann), sorted(rl.loop))
    unix_vs_pairs_us = (offset - rl.epoch_offset) / 1e3 if pairs else None
    offset = offset if pairs else rl.epoch_offset
    shift = lambda rs: [(s + offset, e + offset, name) for s, e, name in rs]  # noqa: E731
    rl.loop, rl.worker = shift(rl.loop), shift(rl.worker)
    for st in rl.steps:
        st["launch"] = (st["launch"][0] + offset, st["launch"][1] + offset)
    rl.marks = {k: v + offset for k, v in rl.marks.items()}
    starts = sorted((st["launch"][0], st["launch"][1], i) for i, st in enumerate(rl.steps))
    keys = [s for s, _, _ in starts]

    def step_of(t: int | None) -> int:  # the launch range a runtime call fell in (a little slack for the clocks)
        j = bisect.bisect_right(keys, t + LAUNCH_SLACK_NS) - 1 if t is not None else -1
        return starts[j][2] if j >= 0 and t <= starts[j][1] + LAUNCH_SLACK_NS else -1

    ops = [(s, e, step_of(launches.get(c))) for s, e, c in raw]
    if not cuda:  # CPU: the worker's forwards are the device
        ops = [(st["launch"][0], st["launch"][1], i) for i, st in enumerate(rl.steps)]
    first: dict[int, int] = {}
    for s, _, i in ops:
        if i >= 0 and s < first.get(i, s + 1):
            first[i] = s
    lead = sorted((s - rl.steps[i]["launch"][0]) / 1e3 for i, s in first.items())  # < 0: the clocks disagree
    meta = {"activity_types": types, "annotations_profiler": len(ann), "annotations_logged": len(rl.loop),
            "annotations_paired": pairs, "clock_offset_ns": offset, "unix_clock_minus_paired_us": unix_vs_pairs_us,
            "device_ops": len(ops), "device_ops_tied_to_a_step": sum(1 for o in ops if o[2] >= 0),
            "first_op_after_launch_us": {q: lead[int(q * (len(lead) - 1))] for q in (0.0, 0.1, 0.5)} if lead else None,
            "runtime_calls": {k: {"count": c, "ms": ns / 1e6} for k, (c, ns) in
                              sorted(runtime.items(), key=lambda kv: -kv[1][1])[:16]},
            "device_source": "CUDA kernels, copies, sets" if cuda else "CPU smoke: the worker's forwards",
            "extract_s": time.perf_counter() - t0}
    return ops, meta


def run_window(rl: RangeLog, ops: list[tuple[int, int, int]]) -> tuple[int, int]:
    """First submission to the last token: the flush's end to the last processing or delivery."""
    ends = [e for _, e, name in rl.loop if name in ("process", "deliver")] or [e for _, e, _ in ops]
    submit = rl.marks.get("submit", min(s for s, _, _ in rl.loop))
    return submit, max(ends)


KEEP = ("tok_s", "wall_s", "gpu_busy_mean", "cpu_over_wall", "ttft_median_s", "decode_steps", "fused_decode_launches")


async def profile_mode(args: argparse.Namespace, eng: Engine, loop: str, mode: str, wl: Workload, warm_up: bool) -> dict[str, Any]:
    """(A warm run,) a plain run, a profiled run with the ranges, and its analysis."""
    cuda = args.device == "cuda"
    temp = 0.6 if mode == "sampled" else 0.0
    warm = await run_nv(eng, wl, temp) if warm_up else None
    plain = await run_nv(eng, wl, temp)
    rl = RangeLog()
    rl.install(eng)
    acts = [getattr(torch.profiler.ProfilerActivity, a.upper()) for a in args.activities if cuda or a == "cpu"]
    acts = acts or [torch.profiler.ProfilerActivity.CPU]
    prof = torch.profiler.profile(activities=acts, record_shapes=False, with_stack=False, profile_memory=False)
    prof.__enter__()
    # Our analysis reads kineto's events; a torch that turns them all into FunctionEvents when
    # the profiler stops (older ones do, newer ones lazily) would spend seconds per 10^5 events.
    prof.profiler._parse_kineto_results = lambda *a, **k: []
    try:
        profiled = await run_nv(eng, wl, temp)
    finally:
        rl.uninstall()
        t0 = time.perf_counter()
        prof.__exit__(None, None, None)
        stop_s = time.perf_counter() - t0
    ops, meta = kineto_view(prof, rl, cuda)
    if cuda and not meta["device_ops"]:
        log(f"  no device ops in the trace (activity types seen: {meta['activity_types']})")
    if args.trace_dir:
        t1 = time.perf_counter()
        Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(Path(args.trace_dir) / f"trace_{loop}_{mode}.json"))
        meta["export_s"] = time.perf_counter() - t1
    t1 = time.perf_counter()
    res = analyse(ops, rl.loop, rl.worker, rl.steps, run_window(rl, ops), min_gap_ns=int(args.min_gap_us * 1000),
                  syncs=rl.syncs)
    meta.update(profiler_stop_s=stop_s, analyse_s=time.perf_counter() - t1, loop_ranges=len(rl.loop),
                worker_ranges=len(rl.worker))
    return {"warm": {k: warm[k] for k in KEEP} if warm else None, "plain": {k: plain[k] for k in KEEP},
            "profiled": {k: profiled[k] for k in KEEP}, "profile": meta, "gaps": res}


async def profile_loop(args: argparse.Namespace, path: str, loop: str, wl: Workload) -> dict[str, Any]:
    """One engine; per mode a warm run (the first mode only), plain, profiled. A mode that
    fails is recorded as its error and the probe goes on (one run on the GPU must answer)."""
    eng = Engine.from_pretrained(path, loop=loop, device=args.device, dtype=args.dtype)
    out: dict[str, Any] = {}
    async with eng:
        await eng.generate(input_ids=wl.prompts[0][:32], sampling=SamplingParams(max_new_tokens=8))
        for mode in args.modes:
            try:
                out[mode] = await profile_mode(args, eng, loop, mode, wl, warm_up=mode == args.modes[0])
            except Exception as exc:  # keep the other loops' answers
                traceback.print_exc()
                out[mode] = {"error": repr(exc)}
                continue
            print_loop(loop, mode, out[mode])
    del eng
    free_device()
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    shape, name = (SMOKE_SHAPE, "nv-qwen2-smoke") if args.smoke else (QWEN05, "nv-qwen2-05b-bf16")
    folder = Path(tempfile.gettempdir()) / name
    path = str(build_off_this_thread(lambda: make_checkpoint(folder, shape, getattr(torch, args.dtype), args.device)))
    wl = (Workload(args.requests, 0, prompt_len=(10, 40), id_max=1000, new_tokens=(5, 24)) if args.smoke
          else Workload(args.requests, 0))
    result: dict[str, Any] = {"bench": "gpu_gaps", "args": vars(args), "workload": wl.describe(), **facts(), "loops": {}}
    began, longest = time.perf_counter(), 0.0
    for loop in args.loops:
        t0 = time.perf_counter()
        if t0 - began + longest > args.budget_s:
            log(f"  {loop}: skipped, the loops before it took {t0 - began:.0f} s of --budget-s {args.budget_s:g}")
            result["loops"][loop] = {"skipped": "budget"}
            continue
        result["loops"][loop] = await profile_loop(args, path, loop, wl)
        longest = max(longest, time.perf_counter() - t0)
        result["loops"][loop]["probe_s"] = time.perf_counter() - t0
        log(f"  ({loop}: {result['loops'][loop]['probe_s']:.1f} s in all)")
        save_json(args.out, result)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--loops", default="overlap,normal")
    ap.add_argument("--mode", default="sampled", help="sampled, greedy or both (comma list)")
    ap.add_argument("--requests", type=int, default=None, help="default 256 (16 with --smoke)")
    ap.add_argument("--min-gap-us", type=float, default=5.0)
    ap.add_argument("--activities", default="cpu,cuda",
                    help="profiler activities; 'cuda' alone records no CPU ops (less overhead; ranges aligned by the Unix clock)")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="skip a loop when the time so far plus the longest loop's would pass this")
    ap.add_argument("--trace-dir", default=None, help="also export each profiled run's chrome trace there (slow, large)")
    ap.add_argument("--out", default=None, help="JSON (default bench/results/gpu_gaps.json; gpu_gaps_smoke.json with --smoke)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny random Qwen2, 16 requests: checks the probe end to end")
    args = ap.parse_args()
    args.loops = [x for x in args.loops.split(",") if x]
    assert all(x in LOOPS for x in args.loops), args.loops
    args.modes = [x for x in args.mode.split(",") if x]
    args.activities = [x for x in args.activities.split(",") if x in ("cpu", "cuda")]
    assert all(x in ("sampled", "greedy") for x in args.modes), args.modes
    args.requests = args.requests or (16 if args.smoke else 256)
    args.device, args.dtype = ("cpu", "float32") if args.smoke else ("cuda", "bfloat16")
    args.out = args.out or ("gpu_gaps_smoke.json" if args.smoke else "gpu_gaps.json")
    if args.smoke:
        torch.set_num_threads(1)
    t0 = time.perf_counter()
    result = asyncio.run(main_async(args))
    result["probe_s"] = time.perf_counter() - t0
    print_summary(result)
    log(f"\nsaved {save_json(args.out, result)} ({result['probe_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
