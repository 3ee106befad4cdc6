#!/usr/bin/env python
"""What an idle engine costs, and how fast it wakes up.

1. Idle CPU: with an engine started (and warmed up by one request) and no requests,
   the process sleeps for ``--idle`` seconds (default 10). CPU time is read from
   ``time.process_time()`` and ``resource.getrusage`` and reported as % of one core,
   next to the same measurement with no engine at all (the event loop alone). Context
   switches of the process and of each thread (``/proc/self/task``) show whether
   anything polls: an engine that only awaits its channels should cause none.
2. Wake-up latency: ``--requests`` (default 50) sequential requests with
   ``max_new_tokens=1`` on an otherwise idle engine, ``--gap-ms`` apart (default 50 ms,
   long enough for the loop and its worker thread to go back to sleep). Latency is
   ``engine.submit`` -> first stream delta (p50/p99/max); the time the worker thread
   spent in steps before that delta (timed by wrapping the step executor's ``launch``
   on the instance) is reported alongside, so overhead = latency - step. A bare thread-pool round trip
   (submit a no-op, await its future) gives the floor of a cross-thread wake-up.

Runs under uvloop. Results: bench/results/idle_cpu.json (or --out).

    python bench/probes/idle_cpu.py
    python bench/probes/idle_cpu.py --idle 30 --requests 200 --gap-ms 5
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _common and the benchmarks
import _common as C

from omni_async import Engine, SamplingParams

_CLK = os.sysconf("SC_CLK_TCK")


def thread_snapshot() -> dict[int, dict[str, Any]]:
    """Per-thread CPU ticks and context switches from /proc/self/task."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[int, dict[str, Any]] = {}
    for d in Path("/proc/self/task").iterdir():
        try:
            tid = int(d.name)
            stat = (d / "stat").read_text()
            rest = stat[stat.rfind(")") + 2 :].split()
            status = (d / "status").read_text().splitlines()
            sw = {k: int(v) for k, v in (line.split(":") for line in status if "ctxt_switches" in line)}
            out[tid] = {
                "name": names.get(tid, "(native: torch/OpenMP or other)"),
                "cpu_s": (int(rest[11]) + int(rest[12])) / _CLK,
                "voluntary": sw.get("voluntary_ctxt_switches", 0),
                "nonvoluntary": sw.get("nonvoluntary_ctxt_switches", 0),
            }
        except (OSError, ValueError, IndexError):
            continue
    return out


def rusage() -> resource.struct_rusage:
    return resource.getrusage(resource.RUSAGE_SELF)


async def measure_idle(seconds: float) -> dict[str, Any]:
    th0 = thread_snapshot()
    ru0 = rusage()
    pt0 = time.process_time()
    t0 = time.perf_counter()
    await asyncio.sleep(seconds)
    wall = time.perf_counter() - t0
    pt = time.process_time() - pt0
    ru1 = rusage()
    th1 = thread_snapshot()
    ru_cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    threads = []
    for tid, b in sorted(th1.items()):
        a = th0.get(tid, {"cpu_s": 0.0, "voluntary": 0, "nonvoluntary": 0})
        threads.append(
            {
                "tid": tid,
                "name": b["name"],
                "cpu_ms": 1000 * (b["cpu_s"] - a["cpu_s"]),
                "voluntary_switches": b["voluntary"] - a["voluntary"],
                "nonvoluntary_switches": b["nonvoluntary"] - a["nonvoluntary"],
            }
        )
    return {
        "wall_s": wall,
        "process_time_s": pt,
        "rusage_cpu_s": ru_cpu,
        "rusage_utime_s": ru1.ru_utime - ru0.ru_utime,
        "rusage_stime_s": ru1.ru_stime - ru0.ru_stime,
        "cpu_pct_of_one_core": 100.0 * pt / wall,
        "rusage_cpu_pct_of_one_core": 100.0 * ru_cpu / wall,
        "voluntary_switches": ru1.ru_nvcsw - ru0.ru_nvcsw,
        "involuntary_switches": ru1.ru_nivcsw - ru0.ru_nivcsw,
        "switches_per_s": ((ru1.ru_nvcsw - ru0.ru_nvcsw) + (ru1.ru_nivcsw - ru0.ru_nivcsw)) / wall,
        "threads": threads,
        "thread_count": len(threads),
    }


async def executor_roundtrip(n: int, gap_s: float) -> dict[str, Any]:
    """Floor: a no-op through a one-thread pool and back to the loop, from idle."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    lat = []
    try:
        for _ in range(n):
            await asyncio.sleep(gap_s)
            t0 = time.perf_counter()
            await asyncio.wrap_future(pool.submit(lambda: None))
            lat.append(time.perf_counter() - t0)
    finally:
        pool.shutdown(wait=True)
    return {"n": n, "p50_us": 1e6 * C.percentile(lat, 50), "p99_us": 1e6 * C.percentile(lat, 99), "max_us": 1e6 * max(lat)}


async def measure_wakeup(engine: Engine, prompt: list[int], n: int, gap_s: float) -> dict[str, Any]:
    # Time what the worker thread runs: wrap the step executor's ``launch`` on the
    # instance (whatever runner method a step uses, it goes through there). The package
    # is untouched; the wrapper is removed afterwards.
    executor = engine.scheduler.executor
    spans: list[tuple[float, float]] = []  # (start, end) of each step on the worker
    orig_launch = executor.launch

    def timed_launch(fn: Any, *args: Any) -> Any:
        def timed(*a: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a)
            finally:
                spans.append((t, time.perf_counter()))

        return orig_launch(timed, *args)

    executor.launch = timed_launch
    sampling = SamplingParams(max_new_tokens=1, ignore_eos=True)
    first: list[float] = []
    done: list[float] = []
    step: list[float] = []
    overhead: list[float] = []
    n_steps = 0
    try:
        for i in range(n):
            await asyncio.sleep(gap_s)
            k = len(spans)
            t0 = time.perf_counter()
            handle = await engine.submit(input_ids=prompt, sampling=sampling)
            t_first = None
            async for _delta in handle:
                if t_first is None:
                    t_first = time.perf_counter()
            t_done = time.perf_counter()
            await asyncio.sleep(0.005)  # a speculative step launched past the end still counts below
            mine = spans[k:]
            n_steps += len(mine)
            first.append(t_first - t0)
            done.append(t_done - t0)
            before = sum(e - s for s, e in mine if e <= t_first)
            if mine:
                step.append(before)
                overhead.append(first[-1] - before)
    finally:
        del executor.launch
    return {
        "n": n,
        "gap_ms": 1000 * gap_s,
        "first_delta_p50_ms": C.ms(C.percentile(first, 50)),
        "first_delta_p99_ms": C.ms(C.percentile(first, 99)),
        "first_delta_max_ms": C.ms(max(first)),
        "first_delta_min_ms": C.ms(min(first)),
        "stream_end_p50_ms": C.ms(C.percentile(done, 50)),
        "step_p50_ms": C.ms(C.percentile(step, 50)),
        "overhead_p50_ms": C.ms(C.percentile(overhead, 50)),
        "overhead_p99_ms": C.ms(C.percentile(overhead, 99)),
        "steps_per_request": n_steps / n if n else None,
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    loops = C.parse_loops(args.loops)
    facts = C.machine_facts()
    facts["event_loop"] = C.event_loop_name()
    facts["malloc"] = args.malloc_info
    prompt = C.make_prompts(1, args.seed, args.prompt_len, args.prompt_len)[0]
    gap = args.gap_ms / 1000.0

    print(f"no engine: idle {args.idle:.0f} s ...", flush=True)
    base_idle = await measure_idle(args.idle)
    floor = await executor_roundtrip(args.requests, gap)
    print(
        f"  CPU {base_idle['cpu_pct_of_one_core']:.3f}% of a core, {base_idle['switches_per_s']:.1f} switches/s; "
        f"thread-pool round trip p50 {floor['p50_us']:.0f} us",
        flush=True,
    )

    rows = []
    for name in loops:
        engine = Engine.from_pretrained(args.model, device="cpu", loop=name, seed=args.seed)
        async with engine:
            await engine.generate(input_ids=prompt, sampling=SamplingParams(max_new_tokens=4, ignore_eos=True))
            await asyncio.sleep(0.5)  # let the warm-up's aftermath settle
            idle = await measure_idle(args.idle)
            attempts = 0
            while True:
                attempts += 1
                host = C.HostLoad()
                wake = await measure_wakeup(engine, prompt, args.requests, gap)
                load = host.stop()
                wake["others_cores"] = load["others_cores"]
                wake["steal_cores"] = load["steal_cores"]
                busy = wake["others_cores"] is not None and wake["others_cores"] > args.busy_threshold
                if not busy or attempts > args.busy_retries:
                    break
                print(f"    (other processes used {wake['others_cores']:.2f} cores: re-running the wake-up series)")
                await C.wait_quiet(args.quiet_wait, args.busy_threshold)
            wake["attempts"] = attempts
            wake["disturbed"] = busy
        rows.append({"loop": name, "idle": idle, "wakeup": wake})
        print(
            f"  {name:<12} idle CPU {idle['cpu_pct_of_one_core']:.3f}% of a core "
            f"({idle['switches_per_s']:.1f} switches/s, {idle['thread_count']} threads) | wake-up p50 "
            f"{wake['first_delta_p50_ms']:.2f} ms p99 {wake['first_delta_p99_ms']:.2f} ms "
            f"(step {C.fmt(wake['step_p50_ms'])} ms, overhead {C.fmt(wake['overhead_p50_ms'])} ms)",
            flush=True,
        )

    return {
        "benchmark": "idle_cpu",
        "machine": facts,
        "model": args.model,
        "config": {
            "loops": loops,
            "idle_s": args.idle,
            "requests": args.requests,
            "gap_ms": args.gap_ms,
            "prompt_len": args.prompt_len,
            "max_new_tokens": 1,
            "seed": args.seed,
        },
        "no_engine": {"idle": base_idle, "executor_roundtrip": floor},
        "rows": rows,
    }


def print_table(result: dict[str, Any]) -> None:
    m = result["machine"]
    cfg = result["config"]
    print()
    print(
        f"idle {cfg['idle_s']:.0f} s; wake-up: {cfg['requests']} sequential requests, prompt {cfg['prompt_len']} "
        f"tokens, max_new_tokens=1, {cfg['gap_ms']:.0f} ms apart; cpus={m['cpu_count']} {m['event_loop']}"
    )
    hdr = (
        f"{'engine':<13} {'idle CPU %':>10} {'rusage %':>9} {'sw/s':>6} {'thr':>4} | {'wake p50':>8} {'p99':>7} "
        f"{'max':>7} {'step':>6} {'ovh p50':>7} {'ovh p99':>7} {'steps':>5} {'bg':>5}"
    )
    print(hdr)
    print("-" * len(hdr))
    b = result["no_engine"]["idle"]
    f = result["no_engine"]["executor_roundtrip"]
    print(
        f"{'none':<13} {b['cpu_pct_of_one_core']:>10.3f} {b['rusage_cpu_pct_of_one_core']:>9.3f} "
        f"{b['switches_per_s']:>6.1f} {b['thread_count']:>4} | {f['p50_us'] / 1000:>8.3f} {f['p99_us'] / 1000:>7.3f} "
        f"{f['max_us'] / 1000:>7.3f}  (bare thread-pool round trip)"
    )
    for r in result["rows"]:
        i, w = r["idle"], r["wakeup"]
        print(
            f"{r['loop']:<13} {i['cpu_pct_of_one_core']:>10.3f} {i['rusage_cpu_pct_of_one_core']:>9.3f} "
            f"{i['switches_per_s']:>6.1f} {i['thread_count']:>4} | {w['first_delta_p50_ms']:>8.2f} "
            f"{w['first_delta_p99_ms']:>7.2f} {w['first_delta_max_ms']:>7.2f} {C.fmt(w['step_p50_ms']):>6} "
            f"{C.fmt(w['overhead_p50_ms']):>7} {C.fmt(w['overhead_p99_ms']):>7} {w['steps_per_request']:>5.2f} "
            f"{C.fmt(w['others_cores'], '5.2f')}"
        )
    print(
        "(CPU as % of one core over the idle window; latencies in ms; step = worker-thread step time before the "
        "first delta; ovh = wake-up - step; steps = worker steps per request; bg = cores used by other processes)"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--loops", default=",".join(C.LOOPS))
    p.add_argument("--idle", type=float, default=10.0, help="idle window in seconds")
    p.add_argument("--requests", type=int, default=50, help="sequential max_new_tokens=1 requests")
    p.add_argument("--gap-ms", type=float, default=50.0, help="idle gap before each request")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--busy-threshold", type=float, default=0.3, help="re-run the wake-up series if others used more cores")
    p.add_argument("--busy-retries", type=int, default=1)
    p.add_argument("--quiet-wait", type=float, default=5.0)
    p.add_argument(
        "--malloc", choices=("steady", "default"), default="steady",
        help="steady: pin glibc malloc's mmap/trim thresholds (repeatable runs, see _common.steady_malloc); "
        "default: leave the allocator as it is",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="idle_cpu.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return C.run_benchmark(parse_args(argv), main_async, print_table)


if __name__ == "__main__":
    sys.exit(main())
