"""The batch core's host time per decode step, alone (issue 42): scheduling
(``get_next_batch``) and processing (``process_result``) of B running requests with k
forwards a step, thread CPU time, no model, no runner. With ``--code`` given more than
once each checkout runs in its own process, interleaved per repeat (before/after).

    python tools/core_decode_step.py --code /tmp/before --code . --labels before,after
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # _common and the benchmarks
from _common import add_checkout_options, checkouts, machine_facts, run_child, save_json, spread_summary  # noqa: E402

def one_run(batch: int, k: int, steps: int, lookahead: bool = False) -> dict[str, float]:
    """``lookahead``: the overlap and async-decode loops' order (the next step scheduled
    while the one before is in flight, then that one processed); else the normal loop's."""
    from omni_async.config import SamplingParams, SchedulerConfig
    from omni_async.core.batch_core import NativeBatchCore
    from omni_async.core.multi_step import DecodeSteps
    from omni_async.core.plan import settle
    from omni_async.core.request import Request
    from omni_async.kv.allocator import PageAllocator

    config = settle(SchedulerConfig(max_running_requests=batch, max_prefill_tokens=1 << 16, chunked_prefill_size=1 << 16))
    tiers = DecodeSteps(((1, k),)) if k > 1 else DecodeSteps()
    new = steps * k + 8
    core = NativeBatchCore(config, PageAllocator(batch * (new + 256) // 8, 16), 4096, decode_steps=tiers)
    for i in range(batch):
        core.add_request(Request(rid=f"r{i}", prompt_ids=[3] * (64 + i % 64), sampling=SamplingParams(max_new_tokens=new, ignore_eos=True)))
    while True:  # the prompts' prefill, untimed (decode steps of the first admitted alternate with it)
        b = core.get_next_batch()
        if b.is_decode and b.size == batch and not core.waiting:
            break
        core.process_result(b, [5] * (b.size * max(b.row_steps or [1])))
    assert b.size == batch and not core.waiting, "every request decodes in every step"
    sched = proc = 0.0
    for _ in range(steps):
        tokens = [7] * (b.size * max(b.row_steps or [1]))
        if lookahead:
            t0 = time.thread_time()
            nxt = core.get_next_batch()
            t1 = time.thread_time()
            core.process_result(b, tokens)
            t2 = time.thread_time()
            b = nxt
            sched += t1 - t0
            proc += t2 - t1
            continue
        t0 = time.thread_time()
        core.process_result(b, tokens)
        t1 = time.thread_time()
        b = core.get_next_batch()
        t2 = time.thread_time()
        proc += t1 - t0
        sched += t2 - t1
    n = steps * batch
    return {"schedule_ns_per_row": 1e9 * sched / n, "process_ns_per_row": 1e9 * proc / n}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--lookahead", action="store_true", help="schedule each step before processing the one in flight")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    add_checkout_options(ap, "core_decode_step.json")
    args = ap.parse_args()
    if args.smoke:
        args.batch, args.steps, args.repeats = 16, 5, 1
    if args.child:
        print(json.dumps(one_run(args.batch, args.k, args.steps, args.lookahead)))
        return 0
    here = Path(__file__).resolve()

    codes, labels = checkouts(args, here)
    runs: dict[str, list[dict]] = {label: [] for label in labels}
    child_args = ["--batch", str(args.batch), "--k", str(args.k), "--steps", str(args.steps)] + (["--lookahead"] if args.lookahead else [])
    for _ in range(args.repeats):
        for code, label in zip(codes, labels):
            runs[label].append(run_child(here, code, child_args))
    summary = spread_summary({f"{label}/{key}": [r[key] for r in rs] for label, rs in runs.items()
                              for key in ("schedule_ns_per_row", "process_ns_per_row")})
    path = save_json(args.out, {"config": vars(args), "runs": runs, "summary": summary, "machine": machine_facts()})
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
