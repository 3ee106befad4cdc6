"""CPU threads under a competing process: torch's default (one intra-op thread per core)
against one thread and the engine's own choice (``cpu_threads=None``: the CPUs the load
average leaves idle, at least one).

Each arm is a fresh process (torch's thread count is process-wide, and the engine's
choice reads the load average once per process) that loads the model, warms up, then
times one greedy stream. Arms are interleaved per repeat so load drifts hit them alike.
``--competitors 0,1`` runs the arms with that many busy-loop processes beside them
(started, then ``--settle`` seconds for the load average to see them). The machine's own
load (other users) is recorded with every run.

    python bench/cpu_threads.py --model tiny --competitors 0,1 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import loadavg, machine_facts, save_json  # noqa: E402

ARMS = ("torch", "one", "auto")
BUSY = "while True: pass"


def child(model: str, arm: str, tokens: int) -> dict:
    """One arm in this process: load, warm up, time one stream."""
    import asyncio

    import torch

    from omni_async import Engine, SamplingParams

    threads = {"torch": torch.get_num_threads(), "one": 1, "auto": None}[arm]

    async def run() -> dict:
        async with await Engine.load(model, kv_capacity_tokens=4096, cpu_threads=threads) as engine:
            info = (await engine.model_info())["data"]
            prompt = {"input_ids": list(range(1, 33))}
            await engine.generate(**prompt, sampling=SamplingParams(max_new_tokens=8, ignore_eos=True))
            start = time.perf_counter()
            result = await engine.generate(**prompt, sampling=SamplingParams(max_new_tokens=tokens, ignore_eos=True))
            elapsed = time.perf_counter() - start
        return {
            "arm": arm, "threads": info["cpu_threads"], "reason": info["cpu_threads_reason"],
            "tokens": len(result.output_ids), "seconds": elapsed, "tok_s": len(result.output_ids) / elapsed, "loadavg": loadavg(),
        }

    return asyncio.run(run())


def run_arm(model: str, arm: str, tokens: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    out = subprocess.run(
        [sys.executable, __file__, "--child", model, arm, str(tokens)], env=env, capture_output=True, text=True, check=True, timeout=600
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        model, arm, tokens = sys.argv[2:5]
        print(json.dumps(child(model, arm, int(tokens))))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--tokens", type=int, default=128, help="tokens of the timed stream")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--competitors", default="0,1", help="busy-loop processes beside the arms, per setting")
    ap.add_argument("--settle", type=float, default=30.0, help="seconds after starting the competitors before the first arm")
    ap.add_argument("--out", default="cpu_threads.json")
    args = ap.parse_args()
    runs = []
    for count in [int(c) for c in args.competitors.split(",")]:
        busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(count)]
        try:
            if count:
                time.sleep(args.settle)
            for repeat in range(args.repeats):
                for arm in ARMS:
                    run = {"competitors": count, "repeat": repeat, **run_arm(args.model, arm, args.tokens)}
                    runs.append(run)
                    print(f"competitors {count} repeat {repeat} {arm:>5}: {run['threads']} threads, {run['tok_s']:7.1f} tok/s, load {run['loadavg']}", flush=True)
        finally:
            for p in busy:
                p.kill()
                p.wait()
    print(f"\n{args.model}, one stream of {args.tokens} tokens, median (min-max) tok/s of {args.repeats}:")
    print(f"{'competitors':>11} " + " ".join(f"{arm:>24}" for arm in ARMS) + "   one/torch  auto/torch")
    summary = {}
    for count in sorted({r["competitors"] for r in runs}):
        cells, medians = [], {}
        for arm in ARMS:
            xs = [r["tok_s"] for r in runs if r["competitors"] == count and r["arm"] == arm]
            threads = sorted({r["threads"] for r in runs if r["competitors"] == count and r["arm"] == arm})
            medians[arm] = statistics.median(xs)
            cells.append(f"{medians[arm]:7.1f} ({min(xs):.0f}-{max(xs):.0f}) t={','.join(map(str, threads))}")
        summary[str(count)] = medians
        print(f"{count:>11} " + " ".join(f"{c:>24}" for c in cells) + f"   {medians['one'] / medians['torch']:9.2f}  {medians['auto'] / medians['torch']:10.2f}")
    path = save_json(args.out, {"bench": "cpu_threads", "args": vars(args), "machine": machine_facts(), "runs": runs, "median_tok_s": summary})
    print(f"\nsaved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
