"""A burst of submissions reaching the device (issue 42): NV256's 256 streamed requests
submitted at once with ``asyncio.gather`` to a warm engine on the null device
(``bench/host_overhead.py``), timed from the gather to (a) the last submission returned,
(b) the first prefill launch (the stepper's ``_launch``, wrapped here), (c) the first
token any stream receives; and per request the thread CPU time of its ``submit``. On the
H200 this start left the GPU idle for 69 ms of a 2,339 ms run (docs/host-path.md).

The new tokens per request are ``--new`` (default 8): what is timed ends at the first
token, and shorter runs give more repeats. With ``--code`` given more than once each
checkout runs in its own process, interleaved per repeat (before/after):

    python bench/probes/burst_submit.py --code /tmp/before --code . --labels before,after
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import add_checkout_options, checkouts, machine_facts, run_child, save_json, spread_summary  # noqa: E402

KEYS = ("last_submit_ms", "first_launch_ms", "first_token_ms", "submit_cpu_us_per_req")


async def one_burst(eng, prompts: list[list[int]], new: int) -> dict[str, float]:
    """256 streams at once; the stepper's first launch after the gather is recorded."""
    from omni_async import SamplingParams

    stepper = eng.scheduler.stepper
    marks: dict[str, float] = {}
    inner = stepper._launch

    async def timed_launch(batch, **kw):  # type: ignore[no-untyped-def]
        if not batch.is_decode:
            marks.setdefault("launch", time.perf_counter())
        return await inner(batch, **kw)

    stepper._launch = timed_launch
    cpu: list[float] = []
    returned: list[float] = []

    async def stream(ids: list[int]) -> None:
        c0 = time.thread_time()
        handle = await eng.submit(input_ids=ids, sampling=SamplingParams(max_new_tokens=new, temperature=0.6, ignore_eos=True))
        cpu.append(time.thread_time() - c0)
        returned.append(time.perf_counter())
        async for _ in handle:
            marks.setdefault("token", time.perf_counter())

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(stream(p) for p in prompts))
    finally:
        del stepper._launch  # the class's method again
    return {
        "last_submit_ms": 1e3 * (max(returned) - t0),
        "first_launch_ms": 1e3 * (marks["launch"] - t0),
        "first_token_ms": 1e3 * (marks["token"] - t0),
        "submit_cpu_us_per_req": 1e6 * statistics.mean(cpu),
    }


async def child(requests: int, new: int, bursts: int) -> dict[str, float]:
    """A warm engine (one small burst first), then ``bursts`` measured bursts; medians."""
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from host_overhead import make_engine, nv_workload

    eng = make_engine("overlap", requests, 0.0, kv_per_row=2048)
    prompts, _ = nv_workload(requests, requests, 250, (100, 1024))
    await eng.start()
    try:
        await one_burst(eng, prompts[:16], 2)
        runs = [await one_burst(eng, prompts, new) for _ in range(bursts)]
    finally:
        await eng.aclose()
    return {k: statistics.median(r[k] for r in runs) for k in KEYS}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--new", type=int, default=8)
    ap.add_argument("--bursts", type=int, default=3, help="measured bursts per process (their median)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    add_checkout_options(ap, "burst_submit.json")
    args = ap.parse_args()
    if args.smoke:
        args.requests, args.new, args.bursts, args.repeats = 16, 2, 1, 1
    if args.child:
        print(json.dumps(asyncio.run(child(args.requests, args.new, args.bursts))))
        return 0
    here = Path(__file__).resolve()

    codes, labels = checkouts(args, here)
    runs: dict[str, list[dict]] = {label: [] for label in labels}
    child_args = ["--requests", str(args.requests), "--new", str(args.new), "--bursts", str(args.bursts)]
    for _ in range(args.repeats):
        for code, label in zip(codes, labels):
            runs[label].append(run_child(here, code, child_args))
    summary = spread_summary({f"{label}/{key}": [r[key] for r in rs] for label, rs in runs.items() for key in KEYS}, digits=2)
    path = save_json(args.out, {"config": vars(args), "runs": runs, "summary": summary, "machine": machine_facts()})
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
