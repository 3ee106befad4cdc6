"""How busy the loops keep the GPU (issue: saturate the GPU). Run on the CUDA machine.

Sections, each saved to the JSON as soon as it is done:
- ``w256``: the reference workload (Qwen2-0.5B shape, bf16, 256 requests, prompts
  64-512 tokens, 128 new tokens, greedy, every request streamed), each loop, repeats
  interleaved (loop A, B, C, A, B, C, ...): output tok/s, GPU utilisation sampled
  through NVML every 20 ms, process CPU time over wall time, and the lag of a 1 ms
  ticker coroutine sharing the loop;
- ``scale``: 1,024 requests of the same distribution at several
  ``max_running_requests``;
- ``floor``: N decode graph replays enqueued back to back with one synchronisation at
  the end, against each loop's steady decode step at the same batch size; the host
  cost per running request is (loop step - floor) / batch.

    python bench/gpu_saturation.py --out results.json [--sections w256,scale,floor] [--repeats 3]
"""

from __future__ import annotations

import argparse
from typing import Any
import asyncio
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_suite import QWEN05, _graph_fixture, make_checkpoint, pct, prompts, ticker_lags, workload  # noqa: E402

from omni_async import Engine, SamplingParams  # noqa: E402
from omni_async.backends.native.builder import build_native_stack  # noqa: E402
from omni_async.config import SchedulerConfig  # noqa: E402
from omni_async.core.plan import resolve_decode_steps  # noqa: E402

LOOPS = ("normal", "overlap", "async_decode")
RESULTS: dict = {"sections": {}}
STALLS: list = []  # call sites of loop stalls over 100 ms, per run (see StallWatch)
WINDOWS: list = []  # floor: what each loop_step_ms window ran (step and fused-launch counts)


def log(*a):
    print(*a, flush=True)


class GpuSampler:
    """NVML utilisation (percent of time a kernel ran) sampled every ``period`` s."""

    def __init__(self, period: float = 0.02) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        self.period = period
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self._nvml.nvmlDeviceGetUtilizationRates(self._h).gpu)
            self._stop.wait(self.period)  # a stop ends the wait: joining costs nothing

    def __enter__(self) -> "GpuSampler":
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()

    @property
    def mean(self) -> float | None:
        return statistics.mean(self.samples) if self.samples else None


PREFILL_TOKENS: int | None = 8192
PREFILL_VARIANTS: tuple[int | None, ...] = (8192,)


STEP_VARIANTS: tuple[int | None, ...] = (None,)
FUSE_VARIANTS: tuple[bool, ...] = (True,)  # --fuse: fuse_decode_steps values, side by side in w256
SCALE_GC = "tuned"  # --scale-gc
DECODE_STEPS: int | None = None  # --decode-steps: the engines' decode_steps where a section does not vary it


def engine(path: Path, loop: str, max_running: int, launch: str = "auto", decode_steps: Any = "section",
           prefill: Any = "section", fuse: bool | None = None) -> Engine:
    prefill = PREFILL_TOKENS if prefill == "section" else prefill  # None: the engine's defaults
    budget = {} if prefill is None else {"max_prefill_tokens": prefill, "chunked_prefill_size": prefill}
    return Engine.from_pretrained(
        str(path), device="cuda", loop=loop, dtype="bfloat16", kv_capacity_tokens=1 << 19, step_launch=launch,
        decode_steps=DECODE_STEPS if decode_steps == "section" else decode_steps, **budget,
        fuse_decode_steps=FUSE_VARIANTS[0] if fuse is None else fuse,
        max_running_requests=max_running,
        max_queued_requests=8192, cuda_graph_max_len=1024,
    )


async def run_workload(eng: Engine, reqs: list[list[int]], new: int) -> dict:
    # Every run starts from an empty prefix cache: the repeats send the same prompts, and
    # a warm cache would make every repeat after the first skip most of its prefill.
    flushed = await eng.flush_cache()
    assert flushed.get("success"), flushed
    lags: list[float] = []
    stop = asyncio.Event()
    tick = asyncio.create_task(ticker_lags(stop, lags))

    async def one(p):
        n = 0
        async for d in eng.stream(input_ids=p, sampling=SamplingParams(max_new_tokens=new, ignore_eos=True)):
            n += len(d.token_ids)
        return n

    cpu0 = time.process_time()
    t0 = time.perf_counter()
    watch = StallWatch(stats=eng.scheduler.stats)
    watch_tick = asyncio.create_task(watch.ticker(stop))
    with GpuSampler() as gpu, watch:
        counts = await asyncio.gather(*(one(p) for p in reqs))
        t_end = time.perf_counter()  # before the samplers' threads are joined
    wall = t_end - t0
    cpu = time.process_time() - cpu0
    stop.set()
    await tick
    await watch_tick
    tokens = sum(counts)
    if watch.stalls:
        STALLS.append(watch.stalls[:4])
    return {"stalls_over_100ms": len(watch.stalls), "t_start": t0, "t_end": t_end,
        "tok_s": tokens / wall, "wall_s": wall, "tokens": tokens, "gpu_util_mean": gpu.mean,
        "cpu_over_wall": cpu / wall, "ticker_p50_ms": 1000 * (pct(lags, 50) or 0), "ticker_p99_ms": 1000 * (pct(lags, 99) or 0),
    }


class StallWatch:
    """A watchdog thread: when the loop thread has not come back to a 1 ms ticker for
    ``threshold`` s, it records where every thread is (once per stall), so a long stall
    names its call site instead of showing up only as a ticker percentile."""

    def __init__(self, threshold: float = 0.1, stats: Any = None) -> None:
        self.threshold = threshold
        self.stats = stats  # the scheduler's StepStats: which step the stall came at
        self.started = self.last_tick = time.perf_counter()
        self.loop_thread = threading.get_ident()
        self.stalls: list[dict] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    async def ticker(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.last_tick = time.perf_counter()
            await asyncio.sleep(0.001)

    def _run(self) -> None:
        import traceback

        reported = None
        while not self._stop.wait(0.01):
            since = time.perf_counter() - self.last_tick
            if since > self.threshold and reported != self.last_tick:
                reported = self.last_tick
                frames = sys._current_frames()
                stacks = {("loop" if tid == self.loop_thread else str(tid)): "".join(traceback.format_stack(f)[-14:])
                          for tid, f in frames.items() if tid != threading.get_ident()}
                st = self.stats
                counters = {k: getattr(st, k) for k in ("steps", "prefill_steps", "decode_steps")} if st else {}
                self.stalls.append({"after_s": round(since, 3), "at_s": round(self.last_tick - self.started, 3),
                                    "counters": counters, "stacks": stacks})

    def __enter__(self) -> "StallWatch":
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


class StepTimeline:
    """Per step, where the time goes (bench instrumentation, wrapped around one engine's
    runner and emission): host time to launch, CUDA-event GPU time between the launch's
    first and last enqueue, when the output was collected and processed. Summarised per
    phase: prefill steps (any row prefilling) and decode-only steps."""

    def __init__(self, eng: Engine) -> None:
        self.steps: list[dict] = []
        self.created = time.perf_counter()  # just before the run: the gap to its first launch
        self.closed_at: float | None = None
        st = eng.scheduler.stepper
        runner, sink = st.runner, st.sink
        launch, collect, process = runner.launch, runner.collect, sink.on_step_output
        by_out: dict[int, dict] = {}

        def timed_launch(sched_output, lookahead=False):
            b = sched_output.batch_data
            rec = {"decode": bool(b.is_decode), "rows": b.size, "thread": threading.get_ident(),
                   "ev0": torch.cuda.Event(enable_timing=True), "ev1": torch.cuda.Event(enable_timing=True)}
            rec["ev0"].record()
            t0 = time.perf_counter()
            pending = launch(sched_output, lookahead=lookahead)
            rec["launch_s"] = (t0, time.perf_counter())
            rec["ev1"].record()
            self.steps.append(rec)
            if pending is not None:
                by_out[id(pending)] = rec
            return pending

        def timed_collect(pending):
            t0 = time.perf_counter()
            out = collect(pending)
            rec = by_out.pop(id(pending), None)
            if rec is not None:
                rec["collect_s"] = (t0, time.perf_counter())
                by_out[id(out)] = rec
            return out

        def timed_process(batch, out):
            t0 = time.perf_counter()
            process(batch, out)
            rec = by_out.pop(id(out), None)
            if rec is not None:
                rec["process_s"] = (t0, time.perf_counter())

        runner.launch, runner.collect, sink.on_step_output = timed_launch, timed_collect, timed_process
        self._restore = lambda: (delattr(runner, "launch"), delattr(runner, "collect"), delattr(sink, "on_step_output"))

    def close(self) -> None:
        self.closed_at = time.perf_counter()
        self._restore()

    def summary(self, wall_s: float, run_span: tuple[float, float] | None = None) -> dict:
        torch.cuda.synchronize()
        loop_thread = threading.get_ident()
        out: dict = {"wall_s": wall_s}
        for phase, want in (("prefill", False), ("decode", True)):
            rs = [r for r in self.steps if r["decode"] == want]
            if not rs:
                continue
            gpu = [r["ev0"].elapsed_time(r["ev1"]) for r in rs]
            launch = [1000 * (r["launch_s"][1] - r["launch_s"][0]) for r in rs]
            collect = [1000 * (r["collect_s"][1] - r["collect_s"][0]) for r in rs if "collect_s" in r]
            process = [1000 * (r["process_s"][1] - r["process_s"][0]) for r in rs if "process_s" in r]
            span = (min(r["launch_s"][0] for r in rs), max(r.get("process_s", r["launch_s"])[1] for r in rs))
            out[phase] = {
                "steps": len(rs), "rows_mean": statistics.mean(r["rows"] for r in rs),
                "on_loop_thread": sum(r["thread"] == loop_thread for r in rs),
                "gpu_ms_sum": sum(gpu), "gpu_ms_median": statistics.median(gpu),
                "launch_ms_sum": sum(launch), "launch_ms_median": statistics.median(launch),
                "collect_ms_sum": sum(collect), "process_ms_sum": sum(process),
                "process_ms_median": statistics.median(process) if process else None,
                "first_s": span[0], "last_s": span[1],
            }
        t0 = min(r["launch_s"][0] for r in self.steps)
        start, end = run_span if run_span else (self.created, self.closed_at)
        out["start_gap_ms"] = 1000 * (t0 - start)  # submitting and admitting, before the first launch
        last = max(r.get("process_s", r["launch_s"])[1] for r in self.steps)
        out["end_gap_ms"] = 1000 * ((end or last) - last)  # the last readers, after the last step
        for phase in ("prefill", "decode"):
            if phase in out:
                out[phase]["first_s"] -= t0
                out[phase]["last_s"] -= t0
        out["gpu_busy_from_events"] = sum(out[p]["gpu_ms_sum"] for p in ("prefill", "decode") if p in out) / 1000 / wall_s
        return out


async def section_timeline(path: Path, loops: tuple[str, ...], gc_mode: str = "tuned") -> dict:
    """One W256 run per loop with every step timed (see StepTimeline)."""
    reqs = workload(256, seed=1)
    out = {}
    for loop in loops:
        eng = engine(path, loop, 256)
        async with eng:
            await warm_up(eng)
            apply_gc_mode(gc_mode)
            tl = StepTimeline(eng)
            r = await run_workload(eng, reqs, 128)
            tl.close()
            apply_gc_mode("default")
            out[loop] = {"run": r, "timeline": tl.summary(r["wall_s"], (r["t_start"], r["t_end"]))}
        log("timeline", loop, json.dumps(out[loop], default=lambda x: round(x, 3) if isinstance(x, float) else str(x)))
        del eng
        torch.cuda.empty_cache()
    return out


def summary(runs: list[dict], key: str) -> dict:
    xs = [r[key] for r in runs if r.get(key) is not None]
    if not xs:
        return {}
    med = statistics.median(xs)
    return {"median": med, "min": min(xs), "max": max(xs), "spread_pct": 100 * (max(xs) - min(xs)) / med if med else None}


async def warm_up(eng: Engine) -> None:
    """One unmeasured pass over a workload of the measured size (other prompts): kernel
    compilation, graph buckets, slot growth and pinned host buffers of the measured
    sizes happen here, not in the first measured repeat (a 96-request warm-up left the
    first repeat of every variant 20-40% slower)."""
    await run_workload(eng, workload(256, seed=9), 128)


GC_MODES = ("default", "tuned")


def apply_gc_mode(mode: str) -> None:
    """Switch the process's cyclic GC between runs. ``tuned`` is what the engine options
    ``gc_freeze=True, gc_gen0_threshold=10000`` do at load (applied here per run, so both
    modes run side by side in one process); ``default`` is Python's own."""
    import gc

    if mode == "tuned":
        gc.set_threshold(10_000, 10, 10)
        gc.collect()
        gc.freeze()
    else:
        gc.unfreeze()
        gc.set_threshold(700, 10, 10)


async def section_w256(path: Path, repeats: int, loops: tuple[str, ...] = LOOPS, launches: tuple[str, ...] = ("auto",),
                       gcs: tuple[str, ...] = ("default",)) -> dict:
    """Every (loop, launch, GC mode) variant, repeats interleaved."""
    reqs = workload(256, seed=1)
    steps, budgets, fuses = STEP_VARIANTS, PREFILL_VARIANTS, FUSE_VARIANTS
    combos = [(loop, launch, gc, k, p, f) for f in fuses for p in budgets for k in steps for gc in gcs for launch in launches for loop in loops]

    def name(loop: str, launch: str, gc: str, k: int, p: int | None, f: bool) -> str:
        return "/".join([loop] + ([launch] if len(launches) > 1 else []) + ([gc] if len(gcs) > 1 else [])
                        + ([f"k{k or 'auto'}"] if len(steps) > 1 else []) + ([f"p{p or 'default'}"] if len(budgets) > 1 else [])
                        + (["fused" if f else "unfused"] if len(fuses) > 1 else []))

    variants = {name(*c): c for c in combos}
    engines = {(loop, launch, k, p, f): engine(path, loop, 256, launch, k, p, f) for loop, launch, _gc, k, p, f in combos}
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for eng in engines.values():
        await eng.start()
        await warm_up(eng)
    for rep in range(repeats):
        for v, (loop, launch, gc, k, p, f) in variants.items():
            apply_gc_mode(gc)
            r = await run_workload(engines[(loop, launch, k, p, f)], reqs, 128)
            runs[v].append(r)
            log("w256", rep, v, {k: round(x, 3) if isinstance(x, float) else x for k, x in r.items()})
    apply_gc_mode("default")
    for eng in engines.values():
        await eng.aclose()
    return {v: {"runs": runs[v], "tok_s": summary(runs[v], "tok_s"), "gpu_util": summary(runs[v], "gpu_util_mean"),
                "ticker_p99_ms": summary(runs[v], "ticker_p99_ms")} for v in variants}


async def section_scale(path: Path, loop: str, sizes: list[int]) -> dict:
    reqs = workload(1024, seed=2)
    out = {}
    for mr in sizes:
        eng = engine(path, loop, mr)
        async with eng:
            await warm_up(eng)
            apply_gc_mode(SCALE_GC)
            r = await run_workload(eng, reqs, 128)
            apply_gc_mode("default")
        out[str(mr)] = r
        log("scale", loop, mr, {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()})
        del eng
        torch.cuda.empty_cache()
    return out


FLOOR_GC = "tuned"  # --floor-gc
FLOOR_CONTEXT = 180  # the mean context of loop_step_ms's window (128-token prompts, tokens 8 to 96)


def _own_pages_fixture(stack, bs: int):
    """One decode graph replay where every row attends to its own pages, as the loop's
    rows do (the shared-pages fixture reads one row's KV for all of them, from cache)."""
    graphs, dev, ps = stack.runner.graphs, stack.device, stack.kv.page_size
    pages = -(-(FLOOR_CONTEXT + 1) // ps)
    ids = torch.randint(2, 1000, (bs,), device=dev)
    pos = torch.full((bs,), FLOOR_CONTEXT, device=dev)
    tables = torch.arange(bs * pages, device=dev).view(bs, pages)
    slots = tables[:, FLOOR_CONTEXT // ps] * ps + FLOOR_CONTEXT % ps
    return lambda: graphs.replay(ids, pos, slots, tables, pos + 1)


def _fused_fixture(stack, bs: int):
    """One fused multi-step graph replay (k forwards, own pages), k as the engine's plan
    gives it for ``bs`` rows: what the loop replays from 64 rows. None without one."""
    import numpy as np

    runner, ps = stack.runner, stack.kv.page_size
    fused, k = runner.fused_decode, runner.decode_plan.for_batch(bs)
    bucket = fused.graph_for(bs, 1, k) if fused is not None else None
    if bucket is None:
        return None
    pages = -(-(FLOOR_CONTEXT + k + 1) // ps)
    table = torch.full((bs, fused.max_pages), pages * bs, dtype=torch.long, device=stack.device)
    table[:, :pages] = torch.arange(bs * pages, device=stack.device).view(bs, pages)
    host = np.zeros((bucket, 4), dtype=np.int64)
    host[:bs] = [FLOOR_CONTEXT, 7, k, 0]
    host[:bs, 3] = np.arange(bs)
    last = torch.zeros(bs, dtype=torch.long, device=stack.device)
    return (lambda: fused.run(host, k, bucket, table, last, pages, None)), k


def floor_ms(path: Path, sizes: list[int], reps: int = 100) -> dict:
    """Per forward, graph replays enqueued back to back, one synchronisation at the end:
    ``shared`` (every row on the same 16 pages, the original fixture), ``own`` (each row
    its own pages at the window's mean context) and ``fused`` (the k-forward graph the
    loop replays from 64 rows, own pages; per forward)."""
    config = SchedulerConfig(kv_capacity_tokens=1 << 18, max_running_requests=max(sizes), cuda_graph_max_len=1024)
    stack = build_native_stack(str(path), config, device="cuda", dtype="bfloat16")
    out: dict = {}

    def timed(replay, per: int = 1) -> float:
        for _ in range(5):
            replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            replay()
        torch.cuda.synchronize()
        return 1000 * (time.perf_counter() - t0) / reps / per

    for bs in sizes:
        row = out[bs] = {"shared": timed(_graph_fixture(stack, bs)), "own": timed(_own_pages_fixture(stack, bs))}
        fixture = _fused_fixture(stack, bs)
        if fixture is not None:
            row["fused"] = timed(fixture[0], fixture[1])
    del stack
    torch.cuda.empty_cache()
    return out


async def loop_step_ms(eng: Engine, bs: int, new: int = 96) -> float:
    """Steady decode time per forward while ``bs`` requests decode together: the wall
    time between the moment every request has 8 tokens and the first request's end, over
    the forwards the stage processed in that window (tokens it emitted / ``bs``: every
    request takes one token per forward). Counting launched steps times k instead
    missed the steps in flight at the window's edges, a bias that grows with k."""
    ps = prompts(bs, 150000, 128, 128, seed=bs)
    counts = [0] * bs
    mark: dict[str, float] = {}

    async def one(i, p):
        async for d in eng.stream(input_ids=p, sampling=SamplingParams(max_new_tokens=new, ignore_eos=True)):
            counts[i] += len(d.token_ids)
            if "t1" not in mark and min(counts) >= 8:
                mark["t1"], mark["s1"] = time.perf_counter(), eng.scheduler.info()["decode_steps"]
                mark["i1"] = eng.scheduler.info()
            if d.finished and "t2" not in mark and "t1" in mark:
                mark["t2"], mark["s2"] = time.perf_counter(), eng.scheduler.info()["decode_steps"]
                mark["i2"] = eng.scheduler.info()

    await asyncio.gather(*(one(i, p) for i, p in enumerate(ps)))
    k = resolve_decode_steps(DECODE_STEPS, "cuda").for_batch(bs)
    forwards = (mark["i2"]["tokens_out"] - mark["i1"]["tokens_out"]) / bs
    window = {key: mark["i2"].get(key, 0) - mark["i1"].get(key, 0) for key in
              ("decode_steps", "fused_decode_launches", "fused_decode_replays", "iterations", "num_retractions")}
    window.update(bs=bs, k=k, forwards=forwards, forwards_by_steps=k * window["decode_steps"],
                  window_ms=1000 * (mark["t2"] - mark["t1"]))
    WINDOWS.append(window)
    return 1000 * (mark["t2"] - mark["t1"]) / max(1.0, forwards)


async def section_floor(path: Path, sizes: list[int]) -> dict:
    """Each loop's steady step per forward against the floors of floor_ms; ``floor_ms``
    is the graph the loop replays at that size (fused from 64 rows when it exists), own
    pages; ratios against the shared-pages fixture are kept for continuity."""
    floors = floor_ms(path, sizes)
    out = {}
    for bs in sizes:
        f = floors[bs]
        out[str(bs)] = {"floor_ms": f.get("fused", f["own"]) if bs >= 64 else f["own"], "floor_own_ms": f["own"],
                        "floor_shared_ms": f["shared"], "floor_fused_ms": f.get("fused")}
    for loop in LOOPS:
        eng = engine(path, loop, max(sizes))
        async with eng:
            await eng.generate(input_ids=[5] * 64, sampling=SamplingParams(max_new_tokens=8))
            apply_gc_mode(FLOOR_GC)  # as in the other sections (a full pass of the default GC can stall a window)
            for bs in sizes:
                ms = await loop_step_ms(eng, bs)
                row = out[str(bs)]
                floor = row["floor_ms"]
                row[f"{loop}_ms"] = ms
                row[f"{loop}_ratio"] = ms / floor
                row[f"{loop}_ratio_shared"] = ms / row["floor_shared_ms"]
                row[f"{loop}_host_us_per_req"] = 1000 * (ms - floor) / bs
            apply_gc_mode("default")
        log("floor", loop, {bs: {k: round(v, 3) if isinstance(v, float) else v for k, v in out[str(bs)].items()} for bs in map(str, sizes)})
        del eng
        torch.cuda.empty_cache()
    return out


def main() -> None:
    global PREFILL_TOKENS, PREFILL_VARIANTS, DECODE_STEPS, STEP_VARIANTS, SCALE_GC, FUSE_VARIANTS, FLOOR_GC
    import uvloop

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_saturation.json")
    ap.add_argument("--sections", default="w256,scale,floor")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--loops", default=",".join(LOOPS))
    ap.add_argument("--prefill-tokens", default=str(PREFILL_TOKENS),
                    help="max_prefill_tokens and chunked_prefill_size (default: the engine's): w256 compares a list; other sections use the first")
    ap.add_argument("--launches", default="auto", help="step_launch variants to compare, e.g. thread,inline")
    ap.add_argument("--gc", default="default", help="GC modes for w256, side by side: default,tuned (see apply_gc_mode)")
    ap.add_argument("--scale-loop", default="overlap")
    ap.add_argument("--scale-gc", default="tuned", help="GC mode of the scale section's runs")
    ap.add_argument("--scale-sizes", default="64,128,256,512")
    ap.add_argument("--floor-sizes", default="8,32,64,128,256")
    ap.add_argument("--floor-gc", default="tuned", help="GC mode of the floor section's loop runs")
    ap.add_argument("--decode-steps", default="auto", help="decode_steps values (auto: the engine's default): w256 compares them side by side; other sections use the first")
    ap.add_argument("--profile", default="", help="write a cProfile of the loop thread (top functions) here")
    ap.add_argument("--fuse", default="on", help="fuse_decode_steps values: w256 compares them side by side (on,off); other sections use the first")
    args = ap.parse_args()
    FUSE_VARIANTS = tuple(x == "on" for x in args.fuse.split(","))
    STEP_VARIANTS = tuple(None if x == "auto" else int(x) for x in args.decode_steps.split(","))
    DECODE_STEPS = STEP_VARIANTS[0]
    PREFILL_VARIANTS = tuple(None if x == "default" else int(x) for x in args.prefill_tokens.split(","))
    PREFILL_TOKENS = PREFILL_VARIANTS[0]
    SCALE_GC = args.scale_gc
    FLOOR_GC = args.floor_gc
    RESULTS["config"] = {"prefill_tokens": args.prefill_tokens, "launches": args.launches, "gc": args.gc, "decode_steps": args.decode_steps, "scale_gc": args.scale_gc,
                         "fuse": args.fuse}
    RESULTS["machine"] = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cpu_count": os.cpu_count(),
                          "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
    path = make_checkpoint(Path("/tmp/omni_bench/qwen05"), QWEN05)
    wanted = args.sections.split(",")

    def save():
        RESULTS["stalls"] = STALLS
        RESULTS["floor_windows"] = WINDOWS
        Path(args.out).write_text(json.dumps(RESULTS, indent=1, default=str))

    for name, make in (
        ("w256", lambda: section_w256(path, args.repeats, tuple(args.loops.split(",")), tuple(args.launches.split(",")),
                                       tuple(args.gc.split(",")))),
        ("scale", lambda: section_scale(path, args.scale_loop, [int(x) for x in args.scale_sizes.split(",")])),
        ("floor", lambda: section_floor(path, [int(x) for x in args.floor_sizes.split(",")])),
        ("timeline", lambda: section_timeline(path, tuple(args.loops.split(",")))),
    ):
        if name not in wanted:
            continue
        t0 = time.perf_counter()
        try:
            if args.profile:
                import cProfile
                import io
                import pstats

                prof = cProfile.Profile()
                RESULTS["sections"][name] = prof.runcall(uvloop.run, make())
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(45)
                Path(args.profile).write_text(text.getvalue())
            else:
                RESULTS["sections"][name] = uvloop.run(make())
        except Exception as exc:  # noqa: BLE001
            import traceback

            RESULTS["sections"][name] = {"error": traceback.format_exc()}
            log(name, "failed", exc)
        RESULTS["sections"][name]["section_s"] = time.perf_counter() - t0
        save()
    log(json.dumps(RESULTS, default=str)[:3000])


if __name__ == "__main__":
    main()
