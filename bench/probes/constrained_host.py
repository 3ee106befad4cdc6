#!/usr/bin/env python
"""Host time per constrained row per step, by function: where the loop's (and the
launching thread's) time on constrained rows goes.

Every request under bench/constrained.py's SCHEMA (all rows constrained) on SmolLM2's
49k vocabulary (the real model, CPU, or ``--model tiny``), ``--decode-steps`` forwards per
step; the host functions constrained rows pay for are wrapped with timers: the step's
mask fill (``GrammarMasks.fill``: waiting for the worker, copying the masks), the
matcher's ``accept`` (the library's consume and queueing the next mask), jump-forward
(reading masks, appending forced tokens), processing (``process_multi_step`` /
``process_one_forward``, which include ``accept`` and the walk). Printed per constrained
row-step (a row in a step) and per generated token, with and without jump-forward; and the
steps that sampled under late masks (a constrained row's mask filled after the step before
was processed, while the forward ran: ``core.multi_step.late_mask_rows``) with the seconds
their fills took on the launching thread (on CUDA the loop thread; here the worker). A
version without late masks reports 0 for those.

    python bench/probes/constrained_host.py --requests 32 --tokens 96
    python bench/probes/constrained_host.py --jump off --torch-threads 1   # without jump-forward only
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from _common import machine_facts, save_json  # noqa: E402
from constrained import SCHEMA  # noqa: E402

from omni_async import Engine, SamplingParams  # noqa: E402

TIMES: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
JUMPS = {"both": (False, True), "off": (False,), "on": (True,)}


def timed(owner, name: str, label: str) -> None:
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            rec = TIMES[label]
            rec[0] += time.perf_counter() - t0
            rec[1] += 1

    setattr(owner, name, wrapper)


def install() -> None:
    from omni_async.core import batch_core, multi_step
    from omni_async.structured import batch_mask, grammar, jump

    timed(batch_mask.GrammarMasks, "fill", "mask fill (launching thread)")
    timed(batch_mask, "fill_rows", "fill: rows copied (incl. waits)")
    timed(grammar.GrammarMatcher, "accept", "matcher accept")
    timed(grammar.GrammarMatcher, "next_mask", "matcher next_mask (waits for the worker)")
    timed(jump, "single_token", "jump: one-bit test")
    timed(multi_step, "jump_rows", "jump_rows (whole pass)")
    timed(batch_core, "process_multi_step", "process_multi_step (incl. accept)")
    timed(batch_core, "process_one_forward", "process_one_forward (incl. accept)")
    timed(batch_core.NativeBatchCore, "_schedule_decode", "schedule a decode step")


async def run(args: argparse.Namespace, jump: bool) -> dict:
    TIMES.clear()
    kwargs = dict(device="cpu", loop=args.loop, decode_steps=args.decode_steps, jump_forward=jump)
    async with Engine.from_pretrained(args.model, **kwargs) as engine:
        sp = [SamplingParams(max_new_tokens=args.tokens, temperature=0.6, seed=i, ignore_eos=True, json_schema=SCHEMA)
              for i in range(args.requests)]
        await engine.generate(prompt="warm up", sampling=sp[0])
        TIMES.clear()
        info0 = engine.scheduler.info()
        t0 = time.perf_counter()
        results = await asyncio.gather(*[engine.generate(prompt=f"people {i}:", sampling=s) for i, s in enumerate(sp)])
        wall = time.perf_counter() - t0
        info = engine.scheduler.info()
    d = {k: info[k] - info0.get(k, 0) for k in info if isinstance(info[k], (int, float))}
    tokens = sum(len(r.output_ids) for r in results)
    row_steps = d.get("grammar_mask_rows", 0)
    return {"jump": jump, "wall_s": wall, "tokens": tokens, "row_steps": row_steps, "steps": d.get("steps", 0),
            "skipped": d.get("grammar_forced_skipped", 0), "worker_calls": d.get("grammar_mask_worker_calls"),
            "worker_s": d.get("grammar_mask_worker_s", 0.0), "masked_steps": d.get("grammar_mask_steps", 0),
            "late_steps": d.get("grammar_late_mask_steps", 0), "late_mask_s": d.get("grammar_late_mask_s", 0.0),
            "fill_s": d.get("grammar_mask_s", 0.0), "decode_steps": d.get("decode_steps", 0),
            "times": {k: tuple(v) for k, v in TIMES.items()}}


def report(r: dict) -> None:
    rows = max(r["row_steps"], 1)
    print(f"\njump_forward={r['jump']}: {r['tokens']} tokens in {r['wall_s']:.1f} s, {r['steps']} steps, "
          f"{r['row_steps']} masked row-steps, {r['skipped']} forced tokens skipped")
    masked = max(r["masked_steps"], 1)
    print(f"  {1e3 * r['wall_s'] / max(r['steps'], 1):.1f} ms a step; mask fill {1e3 * r['fill_s'] / masked:.3f} ms per masked step "
          f"on the launching thread; {r['late_steps']} steps under late masks, their fills "
          f"{1e3 * r['late_mask_s'] / max(r['late_steps'], 1):.3f} ms a step")
    calls = r["worker_calls"]
    print(f"  mask worker: {1e3 * r['worker_s'] / masked:.2f} ms per masked step, "
          + (f"{calls / masked:.2f} library calls per masked step, {r['row_steps'] / max(calls, 1):.1f} rows a call"
             if calls is not None else "calls not counted (before the step's rows went as one ticket)"))
    print(f"  {'function':45s} {'calls':>7s} {'total ms':>9s} {'us/row-step':>12s} {'us/token':>9s}")
    for label, (sec, calls) in sorted(r["times"].items(), key=lambda kv: -kv[1][0]):
        print(f"  {label:45s} {calls:7d} {1e3 * sec:9.1f} {1e6 * sec / rows:12.1f} {1e6 * sec / r['tokens']:9.1f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--loop", default="overlap")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--decode-steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--jump", choices=("both", "off", "on"), default="both", help="jump_forward runs (default both)")
    p.add_argument("--torch-threads", type=int, default=None)
    p.add_argument("--out", default="constrained_host.json")
    args = p.parse_args()
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    install()
    runs = []
    for rep in range(args.repeats):  # interleaved
        for jump in JUMPS[args.jump]:
            r = asyncio.run(run(args, jump))
            runs.append(r)
            report(r)
    path = save_json(args.out, {"machine": machine_facts(), "args": vars(args), "runs": runs})
    print(f"saved {path}")
    for jump in JUMPS[args.jump]:
        walls = [r["wall_s"] for r in runs if r["jump"] == jump]
        print(f"jump_forward={jump}: wall {statistics.median(walls):.1f} s [{min(walls):.1f}-{max(walls):.1f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
