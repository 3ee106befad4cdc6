#!/usr/bin/env python
"""Event-loop lag seen by a co-located coroutine while the engine decodes.

A ticker coroutine shares the event loop with the engine: it sleeps 1 ms in a loop
and records (actual interval - 1 ms). Phases, per model and loop:

* ``no_engine``: the ticker alone (the floor of the timer/event loop itself), once;
* ``idle``: an engine started, no requests;
* ``saturated``: C closed-loop clients (default 32) stream requests of 128 new tokens
  (greedy, ignore_eos) back to back; the ticker runs once every client has its first
  token, for the phase duration, then the clients are cancelled (their requests aborted).

Reported: lag p50/p90/p99/p99.9/max (ms), ticks, and the output tokens/s the engine
kept up during the saturated window. Models: the built-in ``tiny`` and, by default, a
bigger random Llama (hidden 512, 8 layers, vocab 32000) written with transformers'
``save_pretrained`` into a temp folder (``--models tiny`` skips it).

Runs under uvloop. Results: bench/results/loop_lag.json (or --out).

    python bench/loop_lag.py
    python bench/loop_lag.py --models tiny --duration 5 --switch-interval 0.001
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import shutil
import sys
import time
from typing import Any

import _common as C

from omni_async import Engine, SamplingParams

TICK_S = 0.001


async def ticker(duration: float) -> list[float]:
    """Sleep 1 ms repeatedly for ``duration`` s; return each interval's lag (s)."""
    lags: list[float] = []
    end = time.perf_counter() + duration
    prev = time.perf_counter()
    while prev < end:
        await asyncio.sleep(TICK_S)
        now = time.perf_counter()
        lags.append(now - prev - TICK_S)
        prev = now
    return lags


def lag_stats(lags: list[float], wall: float) -> dict[str, Any]:
    worst = max(range(len(lags)), key=lags.__getitem__) if lags else None
    return {
        "lag_max_at_s": sum(lags[:worst]) + TICK_S * worst if worst is not None else None,
        "ticks_over_20ms": sum(1 for x in lags if x > 0.020),
        "ticks": len(lags),
        "ticks_per_s": len(lags) / wall if wall > 0 else None,
        "lag_p50_ms": C.ms(C.percentile(lags, 50)),
        "lag_p90_ms": C.ms(C.percentile(lags, 90)),
        "lag_p99_ms": C.ms(C.percentile(lags, 99)),
        "lag_p999_ms": C.ms(C.percentile(lags, 99.9)),
        "lag_max_ms": C.ms(max(lags) if lags else None),
        "lag_mean_ms": C.ms(sum(lags) / len(lags) if lags else None),
        "frac_over_5ms": sum(1 for x in lags if x > 0.005) / len(lags) if lags else None,
        "frac_over_10ms": sum(1 for x in lags if x > 0.010) / len(lags) if lags else None,
    }


async def measure_ticker(duration: float) -> dict[str, Any]:
    host = C.HostLoad()
    gc0 = [g["collections"] for g in gc.get_stats()]
    t0 = time.perf_counter()
    lags = await ticker(duration)
    wall = time.perf_counter() - t0
    gc1 = [g["collections"] for g in gc.get_stats()]
    out = lag_stats(lags, wall)
    # Full (generation-2) collections stop the loop for as long as they take: ~75 ms
    # with torch imported on this box. See --gc-freeze.
    out["gc_collections"] = [b - a for a, b in zip(gc0, gc1)]
    load = host.stop()
    out["cpu_util_cores"] = load["own_cores"]
    out["others_cores"] = load["others_cores"]
    out["steal_cores"] = load["steal_cores"]
    return out


async def saturated_phase(
    engine: Engine,
    prompts: list[list[int]],
    concurrency: int,
    max_new_tokens: int,
    duration: float,
) -> dict[str, Any]:
    sampling = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    window = {"on": False, "tokens": 0}
    started = asyncio.Event()
    first_seen = 0

    async def client(cid: int) -> None:
        nonlocal first_seen
        k = 0
        while True:
            ids = prompts[(cid + k * concurrency) % len(prompts)]
            k += 1
            first = True
            async for delta in engine.stream(input_ids=ids, sampling=sampling):
                if window["on"]:
                    window["tokens"] += len(delta.token_ids)
                if first and k == 1:
                    first_seen += 1
                    if first_seen == concurrency:
                        started.set()
                first = False

    tasks = [asyncio.create_task(client(i)) for i in range(concurrency)]
    try:
        await asyncio.wait_for(started.wait(), timeout=120)
        steps0 = engine.scheduler.stats.steps
        window["on"] = True
        res = await measure_ticker(duration)
        window["on"] = False
        steps = engine.scheduler.stats.steps - steps0
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    # Cancelled requests are aborted; wait (bounded) until the engine has let them go.
    t_end = time.perf_counter() + 30
    while engine.open_requests and time.perf_counter() < t_end:
        await asyncio.sleep(0.01)
    res["tokens_per_s"] = window["tokens"] / duration
    res["steps_per_s"] = steps / duration
    res["open_requests_after_cancel"] = len(engine.open_requests)
    return res


async def retry_if_busy(args: argparse.Namespace, make: Any) -> dict[str, Any]:
    """Run a phase; if other processes were busy meanwhile, wait for a quiet moment
    and run it again (``--busy-retries`` times at most). The last attempt is kept."""
    attempts = 0
    while True:
        attempts += 1
        res = await make()
        busy = res["others_cores"] is not None and res["others_cores"] > args.busy_threshold
        if not busy or attempts > args.busy_retries:
            res["attempts"] = attempts
            res["disturbed"] = busy
            return res
        print(f"    (other processes used {res['others_cores']:.2f} cores: re-running)", flush=True)
        await C.wait_quiet(args.quiet_wait, args.busy_threshold)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    loops = C.parse_loops(args.loops)
    facts = C.machine_facts()
    facts["event_loop"] = C.event_loop_name()
    facts["malloc"] = args.malloc_info
    prompts = C.make_prompts(4 * args.concurrency, args.seed, args.prompt_min, args.prompt_max)

    print("phase no_engine ...", flush=True)
    baseline = await retry_if_busy(args, lambda: measure_ticker(args.idle_duration))
    print(f"  no engine: lag p50 {baseline['lag_p50_ms']:.3f} p99 {baseline['lag_p99_ms']:.3f} max {baseline['lag_max_ms']:.3f} ms")

    temp_dirs: list[str] = []
    models: list[tuple[str, str, dict[str, Any]]] = []
    for m in [x.strip() for x in args.models.split(",") if x.strip()]:
        if m == "tiny":
            models.append(("tiny", "tiny", dict(C.TINY_DESC)))
        elif m == "llama-random":
            t = time.perf_counter()
            path, desc = C.write_random_llama(
                hidden_size=args.big_hidden, num_layers=args.big_layers, seed=args.seed
            )
            temp_dirs.append(path)
            print(f"wrote random Llama ({desc['params'] / 1e6:.1f} M params) in {time.perf_counter() - t:.1f} s", flush=True)
            models.append(("llama-random", path, desc))
        else:
            models.append((m, m, {"kind": "folder", "path": m}))

    rows: list[dict[str, Any]] = []
    try:
        for label, path, desc in models:
            for name in loops:
                engine = Engine.from_pretrained(path, device="cpu", loop=name, seed=args.seed)
                async with engine:
                    # warm-up: a short burst at the measured concurrency
                    warm = SamplingParams(max_new_tokens=4, ignore_eos=True)
                    await asyncio.gather(
                        *(engine.generate(input_ids=prompts[i], sampling=warm) for i in range(args.concurrency))
                    )
                    if args.gc_freeze:
                        gc.collect()
                        gc.freeze()  # what exists now (modules, model) is never scanned again
                    idle = await retry_if_busy(args, lambda: measure_ticker(args.idle_duration))
                    sat = await retry_if_busy(
                        args,
                        lambda: saturated_phase(engine, prompts, args.concurrency, args.max_new_tokens, args.duration),
                    )
                for phase, res in (("idle", idle), ("saturated", sat)):
                    row = {"model": label, "loop": name, "phase": phase, **res}
                    rows.append(row)
                print(
                    f"  {label:<12} {name:<12} idle p99 {idle['lag_p99_ms']:6.3f} ms | saturated "
                    f"p50 {sat['lag_p50_ms']:6.3f} p99 {sat['lag_p99_ms']:7.3f} max {sat['lag_max_ms']:7.3f} ms "
                    f"({sat['tokens_per_s']:.0f} tok/s)",
                    flush=True,
                )
    finally:
        for d in temp_dirs:
            shutil.rmtree(d, ignore_errors=True)

    # Ratios between loops measured in this run (saturated p99 lag relative to normal).
    for label, _, _ in models:
        base = next((r for r in rows if r["model"] == label and r["loop"] == "normal" and r["phase"] == "saturated"), None)
        for r in rows:
            if base and r["model"] == label and r["phase"] == "saturated":
                r["lag_p99_vs_normal"] = r["lag_p99_ms"] / base["lag_p99_ms"] if base["lag_p99_ms"] else None
                r["tokens_per_s_vs_normal"] = r["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else None

    return {
        "benchmark": "loop_lag",
        "machine": facts,
        "models": {label: desc for label, _, desc in models},
        "config": {
            "loops": loops,
            "tick_s": TICK_S,
            "concurrency": args.concurrency,
            "max_new_tokens": args.max_new_tokens,
            "prompt_len": [args.prompt_min, args.prompt_max],
            "saturated_duration_s": args.duration,
            "idle_duration_s": args.idle_duration,
            "switch_interval_s": sys.getswitchinterval(),
            "gc_freeze": args.gc_freeze,
            "gc_threshold": gc.get_threshold(),
            "seed": args.seed,
        },
        "no_engine": baseline,
        "rows": rows,
    }


def print_table(result: dict[str, Any]) -> None:
    m = result["machine"]
    cfg = result["config"]
    print()
    print(
        f"ticker: sleep {cfg['tick_s'] * 1000:.0f} ms; saturated = {cfg['concurrency']} clients x "
        f"{cfg['max_new_tokens']} new tokens; cpus={m['cpu_count']} torch threads={m['torch_num_threads']} "
        f"switch interval={cfg['switch_interval_s'] * 1000:.1f} ms; {m['event_loop']}"
    )
    hdr = (
        f"{'model':<13} {'loop':<12} {'phase':<9} {'p50':>7} {'p90':>7} {'p99':>7} {'p99.9':>7} {'max':>7} "
        f"{'>5ms':>6} {'ticks/s':>7} {'tok/s':>7} {'p99 x':>6} {'bg':>5} {'gc2':>3}"
    )
    print(hdr)
    print("-" * len(hdr))
    b = result["no_engine"]
    print(
        f"{'-':<13} {'-':<12} {'no_engine':<9} {b['lag_p50_ms']:7.3f} {b['lag_p90_ms']:7.3f} {b['lag_p99_ms']:7.3f} "
        f"{b['lag_p999_ms']:7.3f} {b['lag_max_ms']:7.3f} {100 * b['frac_over_5ms']:5.1f}% {b['ticks_per_s']:7.0f} "
        f"{'-':>7} {'-':>6} {C.fmt(b['others_cores'], '5.2f')} {b['gc_collections'][2]:>3}"
    )
    for r in result["rows"]:
        print(
            f"{r['model']:<13} {r['loop']:<12} {r['phase']:<9} {r['lag_p50_ms']:7.3f} {r['lag_p90_ms']:7.3f} "
            f"{r['lag_p99_ms']:7.3f} {r['lag_p999_ms']:7.3f} {r['lag_max_ms']:7.3f} {100 * r['frac_over_5ms']:5.1f}% "
            f"{r['ticks_per_s']:7.0f} {C.fmt(r.get('tokens_per_s'), '.0f'):>7} {C.fmt(r.get('lag_p99_vs_normal'), '.2f'):>6} {C.fmt(r['others_cores'], '5.2f')} "
            f"{r['gc_collections'][2]:>3}"
        )
    print(
        "(lag = actual sleep interval - 1 ms, in ms; 'p99 x' = saturated p99 lag relative to the normal loop; "
        "'bg' = cores used by other processes meanwhile; 'gc2' = full garbage collections during the phase)"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,llama-random", help="comma-separated: tiny, llama-random, or folders")
    p.add_argument("--loops", default=",".join(C.LOOPS))
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompt-min", type=int, default=32)
    p.add_argument("--prompt-max", type=int, default=128)
    p.add_argument("--duration", type=float, default=5.0, help="seconds of ticker under saturation")
    p.add_argument("--idle-duration", type=float, default=2.0, help="seconds of ticker with the engine idle")
    p.add_argument("--big-hidden", type=int, default=512)
    p.add_argument("--big-layers", type=int, default=8)
    p.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval (default: Python's 5 ms)")
    p.add_argument(
        "--gc-freeze", action="store_true",
        help="gc.freeze() after loading each engine, so full collections skip the ~180k objects of torch & co",
    )
    p.add_argument("--busy-threshold", type=float, default=0.3, help="re-run a phase if others used more cores")
    p.add_argument("--busy-retries", type=int, default=1)
    p.add_argument("--quiet-wait", type=float, default=5.0)
    p.add_argument("--torch-threads", type=int, default=None)
    p.add_argument(
        "--malloc", choices=("steady", "default"), default="steady",
        help="steady: pin glibc malloc's mmap/trim thresholds (repeatable runs, see _common.steady_malloc); "
        "default: leave the allocator as it is",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="loop_lag.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return C.run_benchmark(parse_args(argv), main_async, print_table)


if __name__ == "__main__":
    sys.exit(main())
