"""Where a 1 ms ticker sharing the loop loses its turns during W256 (H200 diagnostic).

For each (loop, GIL switch interval, step launch) variant, one warmed-up W256 run with:
- a 1 ms ticker coroutine recording each turn's lag and the step counters around it, so
  the lags split into the prefill phase (prefill steps still to come) and the decode phase;
- a watchdog thread that, whenever the ticker has been late for more than 2 ms, samples
  where the loop thread and the forward worker are (innermost frames), so the long turns
  name their call sites.

    python tools/ticker_lag.py --loops overlap,normal --switch 0.005,0.0005 --out $OUT/ticker.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # _common and the benchmarks
from gpu_saturation import StepTimeline, apply_gc_mode, engine, warm_up  # noqa: E402
from gpu_suite import QWEN05, make_checkpoint, pct, workload  # noqa: E402

from omni_async import SamplingParams  # noqa: E402


def frame_key(frame, depth: int = 4, ours_only: bool = False) -> str:
    """The innermost ``depth`` frames as file:line:function, innermost first (with
    ``ours_only``, frames of omni_async and this bench only: the call path)."""
    parts = []
    while frame is not None and len(parts) < depth:
        code = frame.f_code
        if not ours_only or "omni_async" in code.co_filename or "bench" in code.co_filename:
            parts.append(f"{Path(code.co_filename).name}:{frame.f_lineno}:{code.co_name}")
        frame = frame.f_back
    return " < ".join(parts)


class TimedAwaitable:
    """Wraps a coroutine so that every resumption (one synchronous segment of the task
    that awaits it, until its next yield to the loop) is timed."""

    def __init__(self, coro, segments: list, stats) -> None:
        self.coro, self.segments, self.stats = coro, segments, stats

    def __await__(self):
        return self

    def __iter__(self):
        return self

    def __next__(self):
        return self.send(None)

    def _timed(self, fn, *args):
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.segments.append((time.perf_counter() - t, t, self.stats.prefill_steps, self.stats.decode_steps))

    def send(self, value):
        return self._timed(self.coro.send, value)

    def throw(self, *exc):
        return self._timed(self.coro.throw, *exc)

    def close(self):
        return self.coro.close()


def segment_summary(segments: list, t0: float) -> dict:
    xs = sorted(d for d, *_ in segments)
    ms = lambda q: round(1000 * xs[min(len(xs) - 1, int(q / 100 * (len(xs) - 1)))], 3) if xs else 0  # noqa: E731
    worst = sorted(segments, reverse=True)[:12]
    return {"count": len(xs), "total_ms": round(1000 * sum(xs), 1), "p50_ms": ms(50), "p99_ms": ms(99),
            "max_ms": round(1000 * xs[-1], 3) if xs else 0, "over_1ms": sum(x > 0.001 for x in xs),
            "worst": [(round(1000 * d, 2), round(1000 * (t - t0), 1), p, k) for d, t, p, k in worst]}


def inside(segments: list, timeline) -> list:
    """For the stage's ten longest segments: the launch / collect / process calls that ran
    inside each, with their durations (ms)."""
    out = []
    for d, t, _, _ in sorted(segments, reverse=True)[:10]:
        parts = []
        for rec in timeline.steps:
            for key in ("launch_s", "collect_s", "process_s"):
                span = rec.get(key)
                if span and t <= span[0] and span[1] <= t + d:
                    parts.append((key[:-2], "decode" if rec["decode"] else "prefill", rec["rows"], round(1000 * (span[1] - span[0]), 2)))
        out.append({"segment_ms": round(1000 * d, 2), "calls": parts, "unaccounted_ms": round(1000 * d - sum(p[3] for p in parts), 2)})
    return out


class LagSampler:
    def __init__(self, stats, threshold: float = 0.002, period: float = 0.0002) -> None:
        self.stats = stats
        self.threshold = threshold
        self.period = period
        self.due = time.perf_counter()
        self.ticks: list[tuple[float, float, int, int]] = []  # (start, lag, prefill steps at end, decode steps at end)
        self.loop_sites: collections.Counter[str] = collections.Counter()
        self.loop_paths: collections.Counter[str] = collections.Counter()  # our frames only, deeper
        self.worker_sites: collections.Counter[str] = collections.Counter()
        self.loop_thread = threading.get_ident()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._watch, daemon=True)

    async def ticker(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            t = time.perf_counter()
            self.due = t + 0.001
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            self.ticks.append((t, max(0.0, now - self.due), self.stats.prefill_steps, self.stats.decode_steps))

    def _watch(self) -> None:
        while not self._stop.wait(self.period):
            if time.perf_counter() - self.due <= self.threshold:
                continue
            frames = sys._current_frames()
            loop_frame = frames.get(self.loop_thread)
            if loop_frame is not None:
                self.loop_sites[frame_key(loop_frame)] += 1
                self.loop_paths[frame_key(loop_frame, 7, ours_only=True)] += 1
            for th in threading.enumerate():
                if th.name.startswith("omni-forward") and th.ident in frames:
                    self.worker_sites[frame_key(frames[th.ident], 3)] += 1

    def __enter__(self) -> "LagSampler":
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()

    def summary(self) -> dict:
        lags = [lag for _, lag, _, _ in self.ticks]
        last_prefill = max((p for *_, p, _ in self.ticks), default=0)
        pre = [lag for _, lag, p, _ in self.ticks if p < last_prefill]
        dec = [lag for _, lag, p, _ in self.ticks if p >= last_prefill]
        ms = lambda xs, q: round(1000 * (pct(xs, q) or 0), 3)  # noqa: E731
        return {
            "ticks": len(lags), "p50_ms": ms(lags, 50), "p99_ms": ms(lags, 99), "max_ms": round(1000 * max(lags, default=0), 3),
            "over_1ms": sum(x > 0.001 for x in lags), "over_5ms": sum(x > 0.005 for x in lags),
            "prefill_ticks": len(pre), "prefill_p99_ms": ms(pre, 99), "prefill_over_1ms": sum(x > 0.001 for x in pre),
            "decode_ticks": len(dec), "decode_p99_ms": ms(dec, 99), "decode_over_1ms": sum(x > 0.001 for x in dec),
            "worst": sorted(((round(1000 * lag, 2), p, d) for _, lag, p, d in self.ticks), reverse=True)[:12],
            "loop_sites": self.loop_sites.most_common(14), "loop_paths": self.loop_paths.most_common(30), "worker_sites": self.worker_sites.most_common(8),
        }


async def one_run(eng, reqs, new: int = 128) -> dict:
    flushed = await eng.flush_cache()
    assert flushed.get("success"), flushed
    stop = asyncio.Event()
    sampler = LagSampler(eng.scheduler.stats)

    end_prof = None
    if PROFILE_END:
        import cProfile

        end_prof = cProfile.Profile()

    async def one(p):
        n = 0
        async for d in eng.stream(input_ids=p, sampling=SamplingParams(max_new_tokens=new, ignore_eos=True)):
            n += len(d.token_ids)
        if end_prof is not None and not ended:  # the first reader done: profile the rest
            ended.append(time.perf_counter())
            end_prof.enable()
        return n

    ended: list[float] = []

    prof = None
    if PROFILE_START:
        import cProfile

        prof = cProfile.Profile()
        executor = eng.scheduler.stepper.executor
        launch = executor.launch

        def first_launch(*a, **kw):  # on the loop thread: the end of the start window
            prof.disable()
            executor.launch = launch
            return launch(*a, **kw)

        executor.launch = first_launch
        prof.enable()
    reader_segments: list = []
    timeline = StepTimeline(eng) if TIMELINE else None
    with sampler:
        tick = asyncio.create_task(sampler.ticker(stop))
        t0 = time.perf_counter()
        STAGE_SEGMENTS.clear()
        counts = await asyncio.gather(*(TimedAwaitable(one(p), reader_segments, eng.scheduler.stats) for p in reqs))
        wall = time.perf_counter() - t0
        if end_prof is not None:
            end_prof.disable()
        stop.set()
        await tick
    if timeline is not None:
        timeline.close()
    out = {"tok_s": sum(counts) / wall, "wall_s": wall, **sampler.summary(),
           "inside_worst_segments": inside(STAGE_SEGMENTS, timeline) if timeline is not None else None,
           "stage_segments": segment_summary(STAGE_SEGMENTS, t0), "reader_segments": segment_summary(reader_segments, t0)}
    import io
    import pstats

    for name, pr in (("start", prof), ("end", end_prof)):
        if pr is None:
            continue
        for key in ("tottime", "cumulative"):
            text = io.StringIO()
            pstats.Stats(pr, stream=text).sort_stats(key).print_stats(45)
            out[f"{name}_profile_{key}"] = text.getvalue()
    if ended:
        out["end_window_ms"] = 1000 * (t0 + wall - ended[0])
    return out


PROFILE_START = False
PROFILE_END = False
STAGE_SEGMENTS: list = []
TIMELINE = True


async def main_async(args) -> dict:
    path = make_checkpoint(Path("/tmp/omni_bench/qwen05"), QWEN05)
    reqs = workload(256, seed=1)
    out: dict = {}
    for loop in args.loops.split(","):
        for launch in args.launches.split(","):
            eng = engine(path, loop, 256, launch)
            run = eng.scheduler.run
            eng.scheduler.run = lambda *a, **kw: TimedAwaitable(run(*a, **kw), STAGE_SEGMENTS, eng.scheduler.stats)
            async with eng:
                await warm_up(eng)
                for rep in range(args.repeats):
                    combos = [(i, sl, g) for i in args.switch.split(",") for sl in args.slices.split(",") for g in args.gc.split(",")]
                    for interval, slice_size, gc_mode in combos:
                        sys.setswitchinterval(float(interval))
                        eng._waker.slice_size = int(slice_size)  # bench only: the readers' wake-up slice
                        apply_gc_mode("tuned")
                        if gc_mode == "off":
                            gc.disable()
                        r = await one_run(eng, reqs)
                        gc.enable()
                        apply_gc_mode("default")
                        sys.setswitchinterval(0.005)
                        name = f"{loop}/{launch}/switch{interval}/slice{slice_size}/gc-{gc_mode}"
                        out.setdefault(name, []).append(r)
                        print(name, rep, json.dumps({k: v for k, v in r.items() if k not in ("loop_sites", "loop_paths", "worker_sites", "worst", "stage_segments", "reader_segments") and "_profile_" not in k}), flush=True)
            del eng
            torch.cuda.empty_cache()
    return out


def main() -> None:
    import uvloop

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="ticker_lag.json")
    ap.add_argument("--loops", default="overlap,normal")
    ap.add_argument("--launches", default="auto")
    ap.add_argument("--switch", default="0.005", help="sys.setswitchinterval values, side by side")
    ap.add_argument("--slices", default="32", help="reader wake-up slice sizes, side by side (100000: all at once)")
    ap.add_argument("--gc", default="tuned", help="GC during the runs, side by side: tuned (frozen heap, gen0 10000), off")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--profile-end", action="store_true", help="cProfile from the first request's end to the last's")
    ap.add_argument("--profile-start", action="store_true", help="cProfile the loop thread from submission to the first launch")
    args = ap.parse_args()
    global PROFILE_START, PROFILE_END
    PROFILE_START, PROFILE_END = args.profile_start, args.profile_end
    res = {"machine": {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cpu_count": os.cpu_count(),
                       "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())},
           "config": vars(args), "runs": uvloop.run(main_async(args))}
    for name, runs in res["runs"].items():
        print(name, "p99", statistics.median(r["p99_ms"] for r in runs), "tok/s", [round(r["tok_s"]) for r in runs])
    Path(args.out).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
