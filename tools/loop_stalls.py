#!/usr/bin/env python
"""Worst event-loop stalls from grammar work and from the cyclic GC, seen by a ticker.

A ticker coroutine shares the loop with the engine (sleep 1 ms, record the overshoot).
Two scenarios, each with the cyclic GC on (as in production):

* ``schema``: a free stream (no grammar) runs while requests with flat JSON-schema objects
  arrive, ``--schema-copies`` of each of ``--schema-sizes`` properties (by default 100,000:
  refused, past OpenAI's 5,000; 5,000, 1,000 and 100: compiled). Reported: the worst ticker
  stall, the free stream's worst inter-token gap and each request's outcome.
* ``tool_tags``: a model's answer of 88,000 characters of repeated, never closed
  ``<tool_call>`` tags, split into calls as the server does on its loop (the whole answer
  once, then streamed in 4-character deltas), while a free stream runs. Reported: the
  worst ticker stall, the free stream's worst gap, and the time each parse took.
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
        schemas = [schema(n) for n in args.schema_sizes for _ in range(args.schema_copies)]
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
            "grammar_requests_s": round(grammar_s, 2), "sizes": [len(b["properties"]) for b in schemas], "outcomes": outcomes,
            "validation_cpu_ms": validation_cpu(args.schema_sizes)}


def validation_cpu(sizes: list[int], repeats: int = 5) -> dict[int, float | None]:
    """The loop thread's CPU for one request's schema checks, by size: the params made and
    checked again at the stage's door (thread CPU time, the least of ``repeats``: what the
    loop spends, whatever else the host runs)."""
    from omni_async.sampling_controls import validate_if_changed

    out: dict[int, float | None] = {}
    for n in sizes:
        body, best = schema(n), None
        for _ in range(repeats):
            t0 = time.thread_time()
            try:
                sp = SamplingParams(max_new_tokens=4, json_schema=body)
                validate_if_changed(sp)
            except errors.InvalidRequestError:
                pass
            spent = time.thread_time() - t0
            best = spent if best is None else min(best, spent)
        out[n] = C.ms(best)
    return out


async def scenario_tool_tags(args: argparse.Namespace) -> dict[str, Any]:
    from omni_async.server.tool_parsers import ToolStream, parse_output
    from omni_async.server.tools import OPEN, ToolPlan

    text = (OPEN * (args.tag_chars // len(OPEN) + 1))[: args.tag_chars]
    plan = ToolPlan(parse=True, names=["get_weather"])
    async with Engine.from_pretrained("tiny", device=args.device, loop="normal") as engine:
        await engine.generate(prompt="warm", sampling=SamplingParams(max_new_tokens=4))
        gaps: list[float] = []

        async def free_stream() -> None:
            prev = time.perf_counter()
            async for _ in engine.stream(prompt="free", sampling=SamplingParams(max_new_tokens=args.free_tokens, ignore_eos=True)):
                now = time.perf_counter()
                gaps.append(now - prev)
                prev = now

        ticker = Ticker()
        tick = asyncio.create_task(ticker.run())
        free = asyncio.create_task(free_stream())
        await asyncio.sleep(0.05)
        t0 = time.perf_counter()
        content, calls = parse_output(text, plan, "hermes")  # on the loop, as the server's whole answer
        whole_s = time.perf_counter() - t0
        await asyncio.sleep(0.01)
        stream, said, t0 = ToolStream(plan, "hermes"), [], time.perf_counter()
        for at in range(0, len(text), 4):  # one delta per loop turn, as the server's stream
            said.append(stream.feed(text[at : at + 4])[0])
            await asyncio.sleep(0)
        said.append(stream.finish()[0])
        stream_s = time.perf_counter() - t0
        assert content == text and not calls and "".join(said) == text
        await free
        stalls = ticker.stop()
        await tick
    return {**stalls, "free_stream_worst_gap_ms": C.ms(max(gaps[1:]) if len(gaps) > 1 else None),
            "whole_parse_ms": C.ms(whole_s), "stream_parse_ms": C.ms(stream_s), "chars": len(text)}


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
            fn = {"schema": scenario_schema, "tool_tags": scenario_tool_tags, "burst": scenario_burst}[name]
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
    p.add_argument("--scenarios", nargs="+", default=["schema", "burst"], choices=["schema", "tool_tags", "burst"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--free-tokens", type=int, default=300)
    p.add_argument("--schema-sizes", type=int, nargs="+", default=[100_000, 5_000, 1_000, 100], help="schema: properties per schema")
    p.add_argument("--schema-copies", type=int, default=2, help="schema: requests per size")
    p.add_argument("--tag-chars", type=int, default=88_000, help="tool_tags: the answer's length")
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
