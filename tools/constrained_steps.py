#!/usr/bin/env python
"""Tokens per decode step per row, constrained rows against free ones, in each loop.

Why: issue 61 asks whether a constrained row samples a token every step in the lookahead
loops (overlap, async_decode) or only every other step (its mask for step N+1 needs step
N's token on the host). Throughput ratios cannot tell that apart from a slower step; this
counts it. It wraps the batch core's ``process_result`` (the one place every step's tokens
land) and, per request, counts the tokens it kept after its first and the steps processed
from the one after that to its last: 1.0 means a token every step, 0.5 every other step;
with k forwards a step a free row reaches k. It also counts the device's decode work (rows
times the forwards a launch runs) per kept token: rows sampling first keep their tokens
only up to a refused one (structured/optimistic.py). Nothing is timed.

    python tools/constrained_steps.py                          # tiny, both libraries, three loops
    python tools/constrained_steps.py --model small-smol --decode-steps 8 --optimistic on --loops overlap
    python tools/constrained_steps.py --device cuda --model qwen05-smol --requests 256 --length 256 --loops overlap
    python tools/constrained_steps.py --model small-smol --decode-steps 8 --loops overlap --backends xgrammar --arms free,quarter
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from omni_async import Engine, SamplingParams  # noqa: E402
from constrained import SCHEMA, SMOL_MODELS, qwen05_smol  # noqa: E402

def watch(core: Any) -> dict[str, Any]:
    """Wrap ``core.process_result``: per request, the tokens it kept after its first (the
    prefill's) and the steps processed from the one after that to its last (its span),
    and the decode steps it was in. Every kind of step counts (a jump-forward's extend
    steps too), so the ratio is tokens per step of the engine."""
    seen: dict[str, Any] = {"step": 0, "decode": 0, "rows": {}, "batch_rows": [], "forwards": 0, "fused": 0,
                            "decode_at": [], "forwards_at": []}  # (both after each step: a window's counts)
    inner = core.process_result

    def process_result(batch: Any, tokens: Any, logprobs: Any = None) -> Any:
        decode = batch.mode.is_decode()
        before = [len(r.output_ids) for r in batch.reqs]
        out = inner(batch, tokens, logprobs)
        seen["step"] += 1
        if decode:
            seen["decode"] += 1
            seen["batch_rows"].append(batch.size)
            steps = getattr(batch, "row_steps", None)
            # the device's work: a launch runs its longest row's forwards for every row
            seen["forwards"] += max(steps) * batch.size if steps else batch.size
            seen["fused"] += bool(steps) and max(steps) > 1
        seen["decode_at"].append(seen["decode"])
        seen["forwards_at"].append(seen["forwards"])
        for r, n0 in zip(batch.reqs, before):
            gained = len(r.output_ids) - n0
            row = seen["rows"].get(r.rid)
            if row is None:
                if gained:  # its first token: the span starts after this step
                    seen["rows"][r.rid] = {"constrained": r.matcher is not None, "tokens": gained - 1,
                                           "first": seen["step"], "last": seen["step"], "in": 0}
                continue
            row["tokens"] += gained
            row["last"] = seen["step"]
            row["in"] += 1
        return out

    core.process_result = process_result
    return seen


def free_window(seen: dict[str, Any]) -> dict[str, Any]:
    """A quarter run's free rows against its constrained ones: tokens per step per row of
    each, and the decode steps and device work (row forwards) until the last free row's
    last step, the free rows' window; the steps after it are constrained rows alone (a
    masked row samples one token of a fused launch, where a free row samples k)."""
    rows = [r for r in seen["rows"].values() if r["last"] > r["first"]]
    free = [r for r in rows if not r["constrained"]]
    cons = [r for r in rows if r["constrained"]]
    end = max(r["last"] for r in free)
    return {"free_tokens_per_step_per_row": statistics.mean(r["tokens"] / (r["last"] - r["first"]) for r in free),
            "constrained_tokens_per_step_per_row": statistics.mean(r["tokens"] / (r["last"] - r["first"]) for r in cons) if cons else None,
            "decode_steps": seen["decode"], "window_decode_steps": seen["decode_at"][end - 1],
            "window_row_forwards": seen["forwards_at"][end - 1], "row_forwards": seen["forwards"]}


async def one_loop(model: str, loop: str, n: int, length: int, backend: str, kwargs: dict[str, Any],
                   arms: tuple[str, ...] = ("free", "all")) -> dict[str, Any]:
    os.environ["OMNI_ASYNC_GRAMMAR_BACKEND"] = backend
    engine = await Engine.load(model, loop=loop, **kwargs)
    out: dict[str, Any] = {}
    async with engine:
        core = engine.scheduler.core
        for arm in arms:
            await engine.flush_cache()
            seen = watch(core)
            info0 = engine.scheduler.info()
            sps = [SamplingParams(max_new_tokens=length, temperature=0.6, seed=i, ignore_eos=True,
                                  json_schema=SCHEMA if arm == "all" or (arm == "quarter" and i % 4 == 3) else None)
                   for i in range(n)]
            prompts = [[(7 * i + j) % 200 + 1 for j in range(8 + i % 5)] for i in range(n)]
            results = await asyncio.gather(*[engine.generate(input_ids=p, sampling=s) for p, s in zip(prompts, sps)])
            info1 = engine.scheduler.info()
            core.process_result = type(core).process_result.__get__(core)
            if arm == "quarter":  # every fourth request constrained (bench/constrained.py's quarter arm)
                out[arm] = free_window(seen)
                continue
            rows = list(seen["rows"].values())
            rows = [r for r in rows if r["last"] > r["first"]]
            per = [r["tokens"] / (r["last"] - r["first"]) for r in rows]
            out[arm] = {
                "tokens_per_step_per_row": statistics.mean(per) if per else None,
                "tokens_per_step_in_batch": (sum(r["tokens"] for r in rows) / sum(r["in"] for r in rows)) if rows else None,
                "share_of_steps_in_batch": statistics.mean(r["in"] / (r["last"] - r["first"]) for r in rows) if rows else None,
                "steps": seen["step"], "decode_steps": seen["decode"], "multi_forward_steps": seen["fused"],
                "row_forwards_per_token": seen["forwards"] / max(1, sum(r["tokens"] for r in rows)), "rows_per_step": statistics.mean(seen["batch_rows"]) if seen["batch_rows"] else 0,
                "late_mask_steps": info1.get("grammar_late_mask_steps", 0) - info0.get("grammar_late_mask_steps", 0),
                "optimistic_refused": info1.get("grammar_optimistic_refused", 0) - info0.get("grammar_optimistic_refused", 0),
                "equal_lengths": all(len(r.output_ids) == length for r in results),
                "backend": info1.get("grammar_backend"), "xgrammar_compiles": info1.get("grammar_xgrammar_compiles"),
                "row_forwards": seen["forwards"],
            }
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"max_running_requests": args.requests, "device": args.device}
    if args.device == "cuda":
        kwargs["dtype"] = "bfloat16"
    if args.decode_steps:
        kwargs["decode_steps"] = args.decode_steps
    if args.optimistic != "default":
        kwargs["optimistic_grammar"] = args.optimistic == "on"
    if args.jump_forward:
        kwargs["jump_forward"] = True
    res: dict[str, Any] = {"args": vars(args), "runs": []}
    if args.model in SMOL_MODELS:  # random weights, SmolLM2's vocabulary (bench/constrained.py)
        args.model = str(qwen05_smol(Path(args.checkpoint_dir) / args.model, small=args.model == "small-smol"))
    for backend in args.backends.split(","):
        for loop in args.loops.split(","):
            r = await one_loop(args.model, loop, args.requests, args.length, backend, kwargs, tuple(args.arms.split(",")))
            res["runs"].append({"backend": backend, "loop": loop, **r})
            f, a, q = r.get("free"), r.get("all"), r.get("quarter")
            if q is not None and f is not None:
                print(f"{backend:10s} {loop:12s} quarter: tokens/step/row free rows {q['free_tokens_per_step_per_row']:.3f}, "
                      f"constrained {q['constrained_tokens_per_step_per_row'] or 0:.3f}; decode steps {q['decode_steps']}, "
                      f"{q['window_decode_steps']} until the last free row (free arm {f['decode_steps']}); row forwards "
                      f"until then {q['window_row_forwards']} (free arm {f['row_forwards']}, "
                      f"x{q['window_row_forwards'] / max(1, f['row_forwards']):.2f})", flush=True)
            if f is None or a is None:
                continue
            print(f"{backend:10s} {loop:12s} tokens/step/row free {f['tokens_per_step_per_row']:.3f} "
                  f"constrained {a['tokens_per_step_per_row']:.3f} (in {a['share_of_steps_in_batch']:.2f} of steps, "
                  f"{a['tokens_per_step_in_batch']:.2f} a step in; late-mask steps {a['late_mask_steps']} of "
                  f"{a['decode_steps']} decode, {a['steps']} steps, {a['multi_forward_steps']} of several forwards; refused guesses "
                  f"{a['optimistic_refused']}; row forwards a token {a['row_forwards_per_token']:.2f}, free "
                  f"{f['row_forwards_per_token']:.2f}; steps free {f['steps']}; xgrammar compiles {a['xgrammar_compiles']})",
                  flush=True)
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="tiny, small-smol (random, SmolLM2's vocabulary), smollm2 or a folder")
    p.add_argument("--checkpoint-dir", default="/tmp/omni-bench-checkpoints")
    p.add_argument("--device", default="cpu")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--length", type=int, default=48)
    p.add_argument("--loops", default="normal,overlap,async_decode")
    p.add_argument("--backends", default="llguidance,xgrammar")
    p.add_argument("--decode-steps", type=int, default=None)
    p.add_argument("--optimistic", choices=("default", "on", "off"), default="default")
    p.add_argument("--jump-forward", action="store_true", help="jump_forward=True (forced runs appended)")
    p.add_argument("--arms", default="free,all", help="free, all and quarter (every fourth request constrained; "
                   "compared with free)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    res = asyncio.run(main_async(args))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
