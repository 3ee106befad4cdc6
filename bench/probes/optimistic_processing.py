#!/usr/bin/env python
"""The host's cost of processing a fused multi-step decode whose rows sampled before their
masks (``structured/optimistic.py``): every token checked by its grammar, against the same
step of free rows.

``--rows`` requests under bench/constrained.py's SCHEMA (SmolLM2's tokenizer), each with
a run of admissible tokens drawn ahead from its own reference matcher; ``--steps`` decode
steps of ``--k`` forwards are processed one after another by
``core.multi_step.process_multi_step`` (the batch core's processing of such a step), once
with the rows constrained (sampling first) and once with the same tokens free. Thread CPU
ns per token, median [min-max] over interleaved repeats.

    python bench/probes/optimistic_processing.py --rows 256 --k 8 --steps 16 --repeats 7
    python bench/probes/optimistic_processing.py --smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from _common import machine_facts, save_json  # noqa: E402
from constrained import SCHEMA  # noqa: E402
from grammar_batch import pick, tokenizer  # noqa: E402

from omni_async import SamplingParams  # noqa: E402
from omni_async.core.batch import ForwardMode, ScheduledBatch  # noqa: E402
from omni_async.core.multi_step import process_multi_step  # noqa: E402
from omni_async.core.request import Request  # noqa: E402
from omni_async.structured.grammar import GrammarCompiler  # noqa: E402


def admissible_runs(compiler: GrammarCompiler, key, rows: int, length: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    runs = []
    for _ in range(rows):
        m = compiler.matcher(key)
        run = []
        for _ in range(length):
            t = pick(m.mask_now() if m.next_mask() is None else m.next_mask(), vocab, rng)
            m.accept(t, prefetch=False)
            run.append(t)
        runs.append(run)
    return runs


def one_pass(compiler, key, runs, k: int, steps: int, constrained: bool) -> float:
    rows = len(runs)
    sp = SamplingParams(max_new_tokens=10**6, ignore_eos=True)
    reqs = []
    for i in range(rows):
        r = Request(rid=f"r{i}", prompt_ids=[1, 2, 3], sampling=sp)
        if constrained:
            r.matcher = compiler.matcher(key)
            r.matcher.masked_until = 0
            r.matcher.accept(runs[i][0], prefetch=False)
        r.output_ids.append(runs[i][0])
        reqs.append(r)
    ns = 0
    for s in range(steps):
        batch = ScheduledBatch(mode=ForwardMode.DECODE, reqs=[], epochs=[], prefix_lens=[], extend_lens=[],
                               samples_kept=[], input_ids=[])
        batch.fill_decode(reqs, [k] * rows, 16, lambda n: list(range(n)))
        tokens = [runs[i][1 + s * k + j] for j in range(k) for i in range(rows)]  # forward-major
        t0 = time.thread_time_ns()
        process_multi_step(batch, tokens, None, 10**9, [], [])
        ns += time.thread_time_ns() - t0
    assert all(len(r.output_ids) == 1 + steps * k for r in reqs)  # every token kept
    return ns / (rows * steps * k)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--tokenizer-dir", default=None)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.smoke:
        args.rows, args.steps, args.repeats = 8, 2, 1
    tok, vocab = tokenizer(args.smoke, args.tokenizer_dir)
    compiler = GrammarCompiler(tok, vocab)
    key = ("json_schema", json.dumps(SCHEMA))
    runs = admissible_runs(compiler, key, args.rows, 1 + args.steps * args.k, vocab)
    times: dict[str, list[float]] = {"free": [], "sampled first": []}
    for rep in range(args.repeats + 1):
        for name in (list(times) if rep % 2 == 0 else list(reversed(times))):
            t = one_pass(compiler, key, runs, args.k, args.steps, name != "free")
            if rep:
                times[name].append(t)
    compiler.close()
    summary = {name: {"ns_per_token": statistics.median(ts), "min": min(ts), "max": max(ts)} for name, ts in times.items()}
    print(f"{args.rows} rows x {args.k} forwards x {args.steps} steps; thread CPU ns a token, median [min-max]")
    for name, s in summary.items():
        print(f"  {name:14s} {s['ns_per_token']:8.0f} [{s['min']:.0f}-{s['max']:.0f}]")
    out = args.out or ("optimistic_processing_smoke.json" if args.smoke else "optimistic_processing_cpu.json")
    print(f"saved {save_json(out, {'machine': machine_facts(), 'args': vars(args), 'summary': summary})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
