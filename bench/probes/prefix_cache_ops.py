"""The prefix cache's page accounting at NV256's shape, alone (issue 42): what the batch
core asks of ``PrefixCache`` for every prompt and every finished request, thread CPU
time, no engine. N requests (prompts of 100-1,024 ids, 100-1,024 new tokens), at most
``--running`` of them holding KV at once: each prompt's pages allocated and indexed
(``insert``, as a prefill step does), and when the oldest running request ends, its
output's pages allocated, indexed and every page released (``release``; cached pages
nobody holds are evicted when an allocation needs them). Random prompts share nothing,
as in NV256. With ``--code`` given more than once each checkout runs in its own
process, interleaved per repeat (before/after).

    python bench/probes/prefix_cache_ops.py --code /tmp/before --code . --labels before,after
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections import deque
from pathlib import Path


def one_run(n: int, running: int, page_size: int, seed: int) -> dict[str, float]:
    from omni_async.kv.allocator import PageAllocator
    from omni_async.kv.prefix_cache import PrefixCache

    rng = random.Random(seed)
    reqs = [([rng.randrange(3, 250) for _ in range(rng.randint(100, 1024))], [rng.randrange(3, 250) for _ in range(rng.randint(100, 1024))])
            for _ in range(n)]
    cache = PrefixCache(PageAllocator(running * 2048 // page_size, page_size))
    live: deque[tuple[list[int], list[int], list[int]]] = deque()
    pages_touched = 0

    def finish() -> int:
        prompt, out, pages = live.popleft()
        tokens = prompt + out
        pages.extend(cache.allocate(-(-len(tokens) // page_size) - len(pages)))
        cache.insert(tokens, pages, len(prompt) // page_size, len(tokens))
        cache.release(pages)
        return len(pages)

    t0 = time.thread_time()
    for prompt, out in reqs:
        if len(live) >= running:
            pages_touched += finish()
        pages = cache.allocate(-(-len(prompt) // page_size))
        cache.insert(prompt, pages, 0, len(prompt))
        live.append((prompt, out, pages))
    while live:
        pages_touched += finish()
    took = time.thread_time() - t0
    ok = cache.flush() and cache.allocator.is_fully_free()
    return {"ms": 1e3 * took, "ns_per_page": 1e9 * took / pages_touched, "pages": pages_touched,
            "evicted": cache.evicted_pages, "flushed_clean": ok}


def child(args: argparse.Namespace) -> None:
    runs = [one_run(args.requests, args.running, args.page_size, seed) for seed in range(args.child_runs)]
    print(json.dumps({"package": __import__("omni_async").__file__, "runs": runs}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--running", type=int, default=512)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--child-runs", type=int, default=3, help="runs per process (seeds 0..N-1); the first warms up")
    ap.add_argument("--code", action="append")
    ap.add_argument("--labels", default="")
    ap.add_argument("--out", default="prefix_cache_ops_cpu.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    bench = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(bench))
    from _common import machine_facts, save_json

    codes = args.code or [str(bench.parent)]
    labels = args.labels.split(",") if args.labels else [Path(c).resolve().name for c in codes]
    per: dict[str, list[float]] = {label: [] for label in labels}
    for rep in range(args.repeats):
        for code, label in zip(codes, labels):
            cmd = [sys.executable, __file__, "--child", "--requests", str(args.requests), "--running", str(args.running),
                   "--page-size", str(args.page_size), "--child-runs", str(args.child_runs)]
            env = dict(os.environ, PYTHONPATH=str(Path(code).resolve()))
            out = json.loads(subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
            assert all(r["flushed_clean"] for r in out["runs"]), "the cache must end empty"
            ns = statistics.median(r["ns_per_page"] for r in out["runs"][1:])
            per[label].append(ns)
            print(f"rep {rep} {label:>8}: {ns:7.1f} ns per page ({out['runs'][1]['pages']} pages, "
                  f"{out['runs'][1]['evicted']} evicted) {out['package']}", flush=True)
    summary = {label: {"median": statistics.median(xs), "min": min(xs), "max": max(xs)} for label, xs in per.items()}
    for label, s in summary.items():
        print(f"{label:>8}: {s['median']:.1f} ns per page [{s['min']:.1f}-{s['max']:.1f}]")
    if len(labels) == 2:
        ratios = [b / a for a, b in zip(per[labels[0]], per[labels[1]])]
        print(f"{labels[1]}/{labels[0]} paired by repeat: median {statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]")
    print("saved", save_json(args.out, {"config": vars(args), "labels": labels, "ns_per_page": per, "summary": summary,
                                         "machine": machine_facts()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
