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
    seen: dict[str, Any] = {"step": 0, "decode": 0, "rows": {}, "batch_rows": [], "forwards": 0, "fused": 0}
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


async def one_loop(model: str, loop: str, n: int, length: int, backend: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    os.environ["OMNI_ASYNC_GRAMMAR_BACKEND"] = backend
    engine = await Engine.load(model, loop=loop, **kwargs)
    out: dict[str, Any] = {}
    async with engine:
        core = engine.scheduler.core
        for arm in ("free", "all"):
            await engine.flush_cache()
            seen = watch(core)
            info0 = engine.scheduler.info()
            sps = [SamplingParams(max_new_tokens=length, temperature=0.6, seed=i, ignore_eos=True,
                                  json_schema=SCHEMA if arm == "all" else None) for i in range(n)]
            prompts = [[(7 * i + j) % 200 + 1 for j in range(8 + i % 5)] for i in range(n)]
            results = await asyncio.gather(*[engine.generate(input_ids=p, sampling=s) for p, s in zip(prompts, sps)])
            info1 = engine.scheduler.info()
            core.process_result = type(core).process_result.__get__(core)
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
            r = await one_loop(args.model, loop, args.requests, args.length, backend, kwargs)
            res["runs"].append({"backend": backend, "loop": loop, **r})
            f, a = r["free"], r["all"]
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
    p.add_argument("--out", default=None)
    args = p.parse_args()
    res = asyncio.run(main_async(args))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
