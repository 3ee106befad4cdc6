"""A burst of arrivals against a 1 ms ticker sharing the loop (isolation issue, item 7).

N requests are put into the stage's inbox at once (max_new_tokens=1, tiny model, CPU);
the ticker's worst lag shows the longest stretch the loop was held, and the time until
every request is answered shows the admission cost. Before the intake rewrite the lag
grew with the square of N (a linear scan per arrival). The remaining long stalls are
Python's cyclic garbage collector walking every live object; each size is run with the
default collector and with ``gc.freeze()`` after the model load, side by side.

    python bench/burst_arrivals.py [--sizes 1000,4000,8000] [--out bench/results/burst_arrivals.json]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from omni_async import IncomingMessage, RequestPayload, SamplingParams  # noqa: E402
from omni_async.backends.native.builder import build_native_stack, build_scheduler  # noqa: E402
from omni_async.config import SchedulerConfig  # noqa: E402


async def burst(n: int, freeze: bool) -> dict:
    config = SchedulerConfig(max_queued_requests=n + 10, max_running_requests=256)
    stack = build_native_stack("tiny", config)
    sched = build_scheduler(stack, config)
    if freeze:  # what is alive after load leaves the collector's scans
        gc.collect()
        gc.freeze()
    lags: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - t - 0.001)

    answered = 0
    async with sched:
        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0.05)
        t0 = time.perf_counter()
        sp = SamplingParams(max_new_tokens=1, ignore_eos=True)
        for i in range(n):
            sched.inbox.send_nowait(IncomingMessage(f"b{i}", "new_request", RequestPayload(f"b{i}", [1 + i % 200, 2], sp)))
        async for msg in sched.outbox:
            if msg.type in ("result", "error"):
                answered += 1
                if answered == n:
                    break
        wall = time.perf_counter() - t0
        done.set()
        await tick
    lags.sort()
    gc.unfreeze()
    return {"n": n, "gc_freeze_after_load": freeze, "answered_s": wall, "ticker_max_lag_ms": 1000 * lags[-1], "ticker_p99_lag_ms": 1000 * lags[int(0.99 * (len(lags) - 1))]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1000,4000,8000")
    ap.add_argument("--out", default="bench/results/burst_arrivals.json")
    args = ap.parse_args()
    rows = [asyncio.run(burst(int(n), freeze)) for n in args.sizes.split(",") for freeze in (False, True)]
    for r in rows:
        print(r)
    Path(args.out).write_text(json.dumps({"machine": {"cpu_count": os.cpu_count(), "python": platform.python_version()}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
