"""Scoring a prompt with ``n`` completions (issue 56): one request with ``n`` completions
and ``prompt_logprobs`` (what an HTTP ``/v1/completions`` request with ``echo``,
``logprobs`` and ``n`` asks for), against the same request unscored and a single scoring.

A random Llama checkpoint (CPU), one prompt of ``--prompt-len`` tokens, ``--new`` tokens
per completion, the prefix cache emptied before each run. Per arm: wall seconds and the
prompt positions computed by prefill steps (``info()["prefill_tokens"]``; None on a
checkout without that counter). With ``--code`` given more than once each checkout runs in
its own process, interleaved per repeat (before/after):

    python bench/probes/n_scoring.py --code /tmp/before --code . --labels before,after
    python bench/probes/n_scoring.py --smoke      # checks the script
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

ARMS = ("scored_n", "unscored_n", "scored_1")


async def one_arm(engine, prompt: list[int], arm: str, n: int, new: int) -> dict[str, float | None]:
    """One request of ``arm``, from an empty prefix cache: wall seconds, prefill positions."""
    from omni_async import SamplingParams

    scored = arm.startswith("scored")
    count = n if arm.endswith("_n") else 1
    sp = SamplingParams(max_new_tokens=new, n=count, temperature=0.8, seed=1, ignore_eos=True, prompt_logprobs=1 if scored else None)
    await engine.flush_cache()
    before = engine.scheduler.info().get("prefill_tokens")
    t0 = time.perf_counter()
    res = await engine.generate(input_ids=prompt, sampling=sp)
    wall = time.perf_counter() - t0
    after = engine.scheduler.info().get("prefill_tokens")
    assert len(res.outputs) == count and (res.prompt_logprobs is not None) == scored
    return {"wall_s": wall, "prefill_tokens": None if before is None else after - before}


async def child(args: argparse.Namespace) -> dict[str, dict[str, float | None]]:
    """A warm engine (one small request first), then each arm ``--runs`` times; medians."""
    import random

    import torch

    torch.set_num_threads(args.threads)
    from _common import write_random_llama

    from omni_async import Engine

    folder, _ = write_random_llama(hidden_size=args.hidden, num_layers=args.layers, intermediate_size=args.hidden * 3,
                                   vocab_size=8000, seed=0)
    rng = random.Random(0)
    prompt = [rng.randrange(3, 8000) for _ in range(args.prompt_len)]
    out: dict[str, dict[str, float | None]] = {}
    async with Engine.from_pretrained(folder, loop="normal", page_size=16) as engine:
        await engine.generate(input_ids=prompt[:32], sampling={"max_new_tokens": 2})
        for arm in ARMS:
            runs = [await one_arm(engine, prompt, arm, args.n, args.new) for _ in range(args.runs)]
            out[arm] = {"wall_s": statistics.median(r["wall_s"] for r in runs), "prefill_tokens": runs[0]["prefill_tokens"]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=12)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--new", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch threads in each process")
    ap.add_argument("--runs", type=int, default=3, help="runs of each arm per process (their median)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    add_checkout_options(ap, "n_scoring.json")
    args = ap.parse_args()
    if args.smoke:
        args.n, args.prompt_len, args.new, args.hidden, args.layers, args.runs, args.repeats = 3, 100, 2, 64, 2, 1, 1
    if args.child:
        print(json.dumps(asyncio.run(child(args))))
        return 0
    here = Path(__file__).resolve()
    codes, labels = checkouts(args, here)
    child_args = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("n", "prompt_len", "new", "hidden", "layers", "threads", "runs")]
    runs: dict[str, list[dict]] = {label: [] for label in labels}
    for _ in range(args.repeats):
        for code, label in zip(codes, labels):
            runs[label].append(run_child(here, code, child_args))
    summary = spread_summary({f"{label}/{arm} s": [r[arm]["wall_s"] for r in rs] for label, rs in runs.items() for arm in ARMS}, digits=3)
    prefill = {f"{label}/{arm}": rs[0][arm]["prefill_tokens"] for label, rs in runs.items() for arm in ARMS}
    for key, tokens in prefill.items():
        print(f"{key:>36} prefill tokens: {tokens}")
    path = save_json(args.out, {"config": vars(args), "runs": runs, "summary": summary, "prefill_tokens": prefill,
                                "machine": machine_facts()})
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
