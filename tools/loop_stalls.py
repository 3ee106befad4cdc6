#!/usr/bin/env python
"""Worst event-loop stalls from grammar work and from the cyclic GC, seen by a ticker.

A ticker coroutine shares the loop with the engine (sleep 1 ms, record the overshoot).
Two scenarios, each with the cyclic GC on (as in production):

* ``schema``: a free stream (no grammar) runs while 4 requests with a 100,000-property JSON
  schema (refused: too large) and 4 with a 100-property schema (compiled) arrive. Reported:
  the worst ticker stall and the free stream's worst inter-token gap.
* ``burst``: 2,000 requests (8 new tokens each) submitted at once. Reported: the worst
  ticker stall, the GC passes during the burst (count and worst pause per generation, from
  ``gc.callbacks``), and the cyclic garbage a request leaves (``gc.collect()``'s count after
  a separate 200-request run with the GC disabled, per request).

Results: bench/results/loop_stalls.json (or --out). ``--device cuda`` runs on the GPU.

    python tools/loop_stalls.py                     # both scenarios, tiny on CPU
    python tools/loop_stalls.py --scenarios burst --device cuda --requests 2000
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # _common and the benchmarks
import _common as C  # noqa: E402

from omni_async import Engine, SamplingParams, errors

TICK_S = 0.001


class Ticker:
    """Records the loop's worst stall while it runs."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self._stop = False

    async def run(self) -> None:
        prev = time.perf_counter()
        while not self._stop:
            await asyncio.sleep(TICK_S)
            now = time.perf_counter()
            self.lags.append(now - prev - TICK_S)
            prev = now

    def stop(self) -> dict[str, Any]:
        self._stop = True
        lags = sorted(self.lags)
        return {"ticks": len(lags), "p99_ms": C.ms(C.percentile(lags, 99)), "max_ms": C.ms(lags[-1] if lags else None)}


class GcWatch:
    """GC passes (count, worst pause) per generation while installed."""

    def __init__(self) -> None:
        self.started: float | None = None
        self.passes = {0: 0, 1: 0, 2: 0}
        self.worst = {0: 0.0, 1: 0.0, 2: 0.0}

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self.started = time.perf_counter()
        elif self.started is not None:
            gen = info["generation"]
            self.passes[gen] += 1
            self.worst[gen] = max(self.worst[gen], time.perf_counter() - self.started)

    def report(self) -> dict[str, Any]:
        return {f"gen{g}": {"passes": self.passes[g], "worst_ms": round(self.worst[g] * 1e3, 2)} for g in (0, 1, 2)}


def schema(n: int) -> dict[str, Any]:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}


async def scenario_schema(args: argparse.Namespace) -> dict[str, Any]:
    async with Engine.from_pretrained("tiny", device=args.device, loop="normal") as engine:
        await engine.generate(prompt="warm", sampling=SamplingParams(max_new_tokens=4, json_schema={"type": "object"}))
        gaps: list[float] = []

        async def free_stream() -> None:
            prev = time.perf_counter()
            async for _ in engine.stream(prompt="free", sampling=SamplingParams(max_new_tokens=args.free_tokens, ignore_eos=True)):
                now = time.perf_counter()
                gaps.append(now - prev)
                prev = now

        # The schemas are the caller's own data: built before the ticker starts, so that
        # it measures the engine's grammar work, not the bench building 400,000 dicts.
        schemas = [schema(100_000) for _ in range(4)] + [schema(100) for _ in range(4)]
        gc.collect()

        async def constrained(body: dict[str, Any]) -> str:
            try:
                sp = SamplingParams(max_new_tokens=4, json_schema=body)
                await engine.generate(prompt="x", sampling=sp)
                return "ok"
            except errors.OmniAsyncError as exc:
                return type(exc).__name__

        ticker = Ticker()
        tick = asyncio.create_task(ticker.run())
        free = asyncio.create_task(free_stream())
        await asyncio.sleep(0.05)
        t0 = time.perf_counter()
        outcomes = await asyncio.gather(*(constrained(body) for body in schemas))
        grammar_s = time.perf_counter() - t0
        await free
        stalls = ticker.stop()
        await tick
    return {**stalls, "free_stream_worst_gap_ms": C.ms(max(gaps[1:]) if len(gaps) > 1 else None),
            "grammar_requests_s": round(grammar_s, 2), "outcomes": outcomes}


async def scenario_burst(args: argparse.Namespace) -> dict[str, Any]:
    sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
    prompts = C.make_prompts(args.requests, seed=1, min_len=8, max_len=32)
    async with Engine.from_pretrained("tiny", device=args.device, loop="normal", max_queued_requests=args.requests * 2,
                                      gc_freeze=args.gc_freeze) as engine:
        await engine.generate(input_ids=prompts[0], sampling=sp)
        # cyclic garbage a request leaves: 200 requests with the GC off, then one collection
        gc.collect()
        gc.disable()
        await asyncio.gather(*(engine.generate(input_ids=p, sampling=sp) for p in prompts[:200]))
        garbage = gc.collect()
        gc.enable()
        watch = GcWatch()
        gc.callbacks.append(watch)
        ticker = Ticker()
        tick = asyncio.create_task(ticker.run())
        t0 = time.perf_counter()
        await asyncio.gather(*(engine.generate(input_ids=p, sampling=sp) for p in prompts))
        wall = time.perf_counter() - t0
        stalls = ticker.stop()
        await tick
        gc.callbacks.remove(watch)
    return {**stalls, "burst_s": round(wall, 2), "gc_freeze": args.gc_freeze, "gc": watch.report(), "cyclic_garbage_per_request": round(garbage / 200, 1)}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"machine": C.machine_facts(), "device": args.device, "runs": []}
    for rep in range(args.repeats):
        for name in args.scenarios:
            fn = {"schema": scenario_schema, "burst": scenario_burst}[name]
            res = await fn(args)
            out["runs"].append({"scenario": name, "repeat": rep, **res})
            print(name, rep, res, flush=True)
    return out


def print_table(result: dict[str, Any]) -> None:
    print(f"{'scenario':8} {'rep':>3} {'max stall ms':>12} {'p99 ms':>8}  extra")
    for r in result["runs"]:
        extra = {k: v for k, v in r.items() if k not in ("scenario", "repeat", "max_ms", "p99_ms", "ticks")}
        print(f"{r['scenario']:8} {r['repeat']:>3} {C.fmt(r['max_ms'], '.1f'):>12} {C.fmt(r['p99_ms'], '.2f'):>8}  {extra}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", nargs="+", default=["schema", "burst"], choices=["schema", "burst"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--free-tokens", type=int, default=300)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--gc-freeze", action="store_true",
                   help="burst: Engine(gc_freeze=True), what loading created is never scanned again")
    p.add_argument("--out", default="loop_stalls.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = C.run_async(main_async(args))
    print_table(result)
    print("saved", C.save_json(args.out, result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
