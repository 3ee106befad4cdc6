#!/usr/bin/env python
"""Whether a grammar's matchers wait for each other across threads: the loop thread's
token checks (``try_consume_tokens``, what processing does per row) while the mask worker
computes masks of other rows, with every matcher copied from one compiled template, and
with the matchers spread over K templates compiled apart.

Why: copies of one compiled llguidance grammar share its lexer behind a lock held for a
whole mask computation (the maskslices branch's reading of llguidance: a plain clone
shares the lexer state), so a loop thread advancing one request may wait for the worker's
mask of another. Thread CPU and wall per call of the checking thread, median [min-max]
over repeats, with and without the worker busy.

    python bench/probes/grammar_copies.py --rows 256 --copies 1,4,8 --repeats 5
    python bench/probes/grammar_copies.py --smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from _common import machine_facts, save_json  # noqa: E402
from constrained import SCHEMA  # noqa: E402
from grammar_batch import pick, tokenizer  # noqa: E402

from omni_async.structured.grammar import GrammarCompiler  # noqa: E402


def matchers(compilers: list[GrammarCompiler], key, rows: int) -> list:
    return [compilers[j % len(compilers)].matcher(key).handle for j in range(rows)]


def walks(tok_vocab: int, compiler: GrammarCompiler, key, rows: int, length: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(rows):
        m = compiler.matcher(key)
        run = []
        for _ in range(length):
            t = pick(m.mask_now(), tok_vocab, rng)
            m.accept(t, prefetch=False)
            run.append(t)
        out.append(run)
    return out


def one(compilers, key, runs, vocab: int, busy: bool) -> tuple[float, float]:
    """us per checked token (wall, thread CPU) on this thread, the worker computing masks
    of the other half of the rows meanwhile when ``busy``."""
    rows = len(runs)
    handles = matchers(compilers, key, 2 * rows)
    mine, theirs = handles[0::2], handles[1::2]  # neighbours share a template when copies < rows
    words = (vocab + 31) // 32
    masks = np.empty((len(theirs), words), dtype=np.int32)
    stop = threading.Event()

    def worker() -> None:
        while not stop.is_set():
            for j, h in enumerate(theirs):
                h.unsafe_compute_mask_ptr(masks[j].ctypes.data, words * 4)

    t = threading.Thread(target=worker, daemon=True)
    if busy:
        t.start()
        time.sleep(0.01)
    w0, c0 = time.perf_counter(), time.thread_time()
    n = 0
    for step in range(len(runs[0])):
        for h, run in zip(mine, runs):
            assert h.try_consume_tokens([run[step]]) == 1
            n += 1
    wall, cpu = time.perf_counter() - w0, time.thread_time() - c0
    stop.set()
    if busy:
        t.join()
    return 1e6 * wall / n, 1e6 * cpu / n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--copies", default="1,4,8")
    p.add_argument("--length", type=int, default=24)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tokenizer-dir", default=None)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.smoke:
        args.rows, args.length, args.repeats, args.copies = 8, 4, 1, "1,2"
    tok, vocab = tokenizer(args.smoke, args.tokenizer_dir)
    key = ("json_schema", json.dumps(SCHEMA))
    copies = [int(c) for c in args.copies.split(",")]
    compilers = [GrammarCompiler(tok, vocab) for _ in range(max(copies))]
    runs = walks(vocab, compilers[0], key, args.rows, args.length)
    results: dict[str, list[tuple[float, float]]] = {}
    for rep in range(args.repeats + 1):
        for c in (copies if rep % 2 == 0 else copies[::-1]):
            for busy in (False, True):
                r = one(compilers[:c], key, runs, vocab, busy)
                if rep:
                    results.setdefault(f"{c} templates, worker {'busy' if busy else 'idle'}", []).append(r)
    for comp in compilers:
        comp.close()
    summary = {}
    print(f"{args.rows} checked rows x {args.length} tokens; us per check on this thread, median [min-max]")
    for name, rs in results.items():
        walls, cpus = [w for w, _ in rs], [c for _, c in rs]
        summary[name] = {"wall_us": statistics.median(walls), "wall_min": min(walls), "wall_max": max(walls),
                         "cpu_us": statistics.median(cpus)}
        print(f"  {name:28s} wall {statistics.median(walls):6.2f} [{min(walls):.2f}-{max(walls):.2f}]  "
              f"cpu {statistics.median(cpus):6.2f}")
    out = args.out or ("grammar_copies_smoke.json" if args.smoke else "grammar_copies_cpu.json")
    print(f"saved {save_json(out, {'machine': machine_facts(), 'args': vars(args), 'summary': summary})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
