#!/usr/bin/env python
"""Constrained requests of a real model asked for JSON: masks first against sampling first
(``optimistic_grammar``, omni_async/structured/optimistic.py), in one process, interleaved.

Workload: ``--requests`` chat requests to the real SmolLM2-135M-Instruct (the embedded
default), each asking for a JSON record of a different person, under SCHEMA (the record's
fields, a bounded name), ``max_new_tokens`` 96; greedy, or temperature 0.6 with a
per-request seed. Arms: ``masked`` (``optimistic_grammar=False``: every token under its
mask), ``optimistic`` (sampling first) and ``free``: the same prompts without the grammar,
``ignore_eos``, each request as many new tokens as its constrained output had in the
optimistic arm's warm-up, so it does the same work (the issue's "all constrained against
all free at equal lengths"); one warm engine each, ``--repeats`` interleaved
repeats with the order rotated (after one warm-up run each); every output is checked
against the schema. Per run: output tok/s, masks computed (rows), tokens admitted as
sampled and refused (rewinds), fused launches, and the host seconds spent on masks.
On CPU the forward dominates a step, so tok/s moves less than the masks do; the figure
that carries to a GPU, whose step is a few ms, is the masks per token.

    python bench/optimistic_grammar.py                      # CPU, SmolLM2, ~5 min
    python bench/optimistic_grammar.py --smoke              # tiny model, seconds
    python bench/optimistic_grammar.py --device cuda --requests 256 --decode-steps auto
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common as C  # noqa: E402

from omni_async import Engine, SamplingParams  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "email": {"type": "string", "maxLength": 40},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "email", "active"],
    "additionalProperties": False,
}
PEOPLE = ["a retired teacher", "a young chef", "a pilot", "a student in Lyon", "a farmer", "a nurse",
          "a software engineer", "a painter", "a bus driver", "a librarian", "a marathon runner", "a baker"]
ARMS = ("masked", "optimistic", "free")
COUNTERS = ("grammar_mask_rows", "grammar_mask_s", "grammar_optimistic_tokens", "grammar_optimistic_refused",
            "fused_decode_launches", "decode_steps", "grammar_mask_worker_s")


def messages(i: int) -> list[dict[str, str]]:
    who = PEOPLE[i % len(PEOPLE)]
    return [{"role": "user", "content": f"Write a JSON record for {who} (number {i}) with the fields name, age, "
                                        "city, email and active. Reply with the JSON only."}]


def valid(text: str) -> bool:
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    return (isinstance(obj, dict) and set(obj) == set(SCHEMA["required"]) and isinstance(obj["age"], int)
            and isinstance(obj["active"], bool) and all(isinstance(obj[k], str) for k in ("name", "city", "email")))


async def one_run(engine: Engine, args: argparse.Namespace, lengths: list[int] | None = None) -> dict[str, Any]:
    """One batch of requests; with ``lengths``, free ones of exactly those lengths."""
    before = engine.scheduler.info()
    seed = lambda i: None if args.temperature == 0 else 1000 + i  # noqa: E731
    if lengths is None:
        sps = [SamplingParams(max_new_tokens=args.new_tokens, json_schema=SCHEMA, temperature=args.temperature, seed=seed(i))
               for i in range(args.requests)]
    else:
        sps = [SamplingParams(max_new_tokens=max(1, n), ignore_eos=True, temperature=args.temperature, seed=seed(i))
               for i, n in enumerate(lengths)]
    t0, c0 = time.perf_counter(), time.process_time()
    results = await asyncio.gather(*[engine.generate(messages=messages(i), sampling=sp) for i, sp in enumerate(sps)])
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    after = engine.scheduler.info()
    tokens = sum(len(r.output_ids) for r in results)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS}
    free = lengths is not None
    return {"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall, "cpu_ms_per_token": 1e3 * cpu / max(tokens, 1),
            "valid": None if free else sum(valid(r.text) for r in results) / len(results),
            "complete": None if free else sum(r.finish_reason == "stop" for r in results) / len(results),
            "masks_per_token": delta["grammar_mask_rows"] / max(tokens, 1), **delta,
            "outputs": [r.output_ids for r in results]}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    model = "tiny" if args.smoke else args.model
    arms = tuple(a for a in ARMS if a in args.arms.split(","))
    if "free" in arms and "optimistic" not in arms:
        raise SystemExit("--arms: free takes its lengths from the optimistic arm")
    engines = {}
    for arm in arms:
        kw: dict[str, Any] = {"optimistic_grammar": arm != "masked"}
        if args.device:
            kw["device"] = args.device
        if args.decode_steps != "auto":
            kw["decode_steps"] = int(args.decode_steps)
        engines[arm] = Engine.from_pretrained(model, loop=args.loop, **kw)
    runs: list[dict[str, Any]] = []
    lengths: list[int] | None = None
    try:
        for arm in arms:  # warm-up: compiles, first masks, graphs; the free arm's lengths
            await engines[arm].__aenter__()
            warm = await one_run(engines[arm], args, lengths if arm == "free" else None)
            if arm == "optimistic":
                lengths = [len(ids) for ids in warm["outputs"]]
        for rep in range(args.repeats):
            order = arms[rep % len(arms):] + arms[:rep % len(arms)]
            for arm in order:
                r = await one_run(engines[arm], args, lengths if arm == "free" else None)
                r.update(arm=arm, repeat=rep)
                runs.append(r)
                print(f"  repeat {rep} {arm:10s} {r['tok_s']:8.1f} tok/s  cpu {r['cpu_ms_per_token']:.2f} ms/token  masks/token {r['masks_per_token']:.3f}  "
                      f"refused {r['grammar_optimistic_refused']}  tokens {r['tokens']}  valid {r['valid']}", flush=True)
    finally:
        for e in engines.values():
            await e.__aexit__(None, None, None)
    greedy_same = None
    if args.temperature == 0:  # greedy: sampling first must give the tokens of masking first
        by_rep = {(r["arm"], r["repeat"]): r["outputs"] for r in runs}
        if "masked" in arms and "optimistic" in arms:
            greedy_same = all(by_rep[("optimistic", k)] == by_rep[("masked", k)] for k in range(args.repeats))
    summary = {}
    for arm in arms:
        mine = [r for r in runs if r["arm"] == arm]
        tps = [r["tok_s"] for r in mine]
        summary[arm] = {"tok_s": statistics.median(tps), "min": min(tps), "max": max(tps),
                        "masks_per_token": statistics.median(r["masks_per_token"] for r in mine),
                        "cpu_ms_per_token": statistics.median(r["cpu_ms_per_token"] for r in mine),
                        "mask_s_per_run": statistics.median(r["grammar_mask_s"] for r in mine),
                        "worker_s_per_run": statistics.median(r["grammar_mask_worker_s"] for r in mine),
                        "refused_per_run": statistics.median(r["grammar_optimistic_refused"] for r in mine),
                        "admitted_per_run": statistics.median(r["grammar_optimistic_tokens"] for r in mine),
                        "tokens": statistics.median(r["tokens"] for r in mine),
                        "valid": None if arm == "free" else min(r["valid"] for r in mine),
                        "complete": None if arm == "free" else min(r["complete"] for r in mine)}
    for r in runs:
        r.pop("outputs")
    return {"machine": C.machine_facts(), "args": vars(args), "arms": list(arms), "summary": summary,
            "greedy_tokens_equal": greedy_same, "lengths": lengths,
            "ratio_optimistic_over_masked": paired(runs, "optimistic", "masked"),
            "ratio_optimistic_over_free": paired(runs, "optimistic", "free"),
            "ratio_masked_over_free": paired(runs, "masked", "free"), "runs": runs}


def paired(runs: list[dict[str, Any]], num: str, den: str) -> dict[str, float] | None:
    """tok/s of ``num`` over ``den``, paired by repeat (None when an arm did not run)."""
    ratios = [a["tok_s"] / b["tok_s"] for a, b in zip([r for r in runs if r["arm"] == num], [r for r in runs if r["arm"] == den])]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)} if ratios else None


def print_table(result: dict[str, Any]) -> None:
    s = result["summary"]
    print(f"{'arm':10s} {'tok/s':>18s} {'cpu ms/tok':>10s} {'masks/token':>12s} {'mask s':>8s} {'worker s':>9s} {'admitted':>9s} "
          f"{'refused':>8s} {'valid':>6s}")
    for arm in result["arms"]:
        a = s[arm]
        valid = "-" if a["valid"] is None else f"{a['valid']:.2f}"
        print(f"{arm:10s} {a['tok_s']:8.1f} [{a['min']:.1f}-{a['max']:.1f}] {a['cpu_ms_per_token']:10.2f} {a['masks_per_token']:12.3f} "
              f"{a['mask_s_per_run']:8.3f} {a['worker_s_per_run']:9.3f} {a['admitted_per_run']:9.0f} "
              f"{a['refused_per_run']:8.0f} {valid:>6s}")
    for num, den in (("optimistic", "masked"), ("optimistic", "free"), ("masked", "free")):
        r = result[f"ratio_{num}_over_{den}"]
        if r is not None:
            print(f"{num} / {den} tok/s, paired by repeat: {r['median']:.3f} [{r['min']:.3f}-{r['max']:.3f}]")
    if result["greedy_tokens_equal"] is not None:
        print(f"greedy tokens equal (optimistic, masked): {result['greedy_tokens_equal']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--device", default=None)
    p.add_argument("--loop", default="overlap")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--decode-steps", default="auto", help="forwards per decode step (auto: the engine's choice)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--arms", default=",".join(ARMS), help="of masked, optimistic, free (free needs optimistic)")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.smoke:
        args.requests, args.new_tokens, args.repeats = 4, 24, 1
    result = C.run_async(main_async(args))
    print_table(result)
    name = args.out or ("optimistic_grammar_smoke.json" if args.smoke else
                        f"optimistic_grammar_{(args.device or 'cpu')}_t{args.temperature:g}.json")
    print(f"saved {C.save_json(name, result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
