#!/usr/bin/env python
"""How a step's grammar masks scale over threads on this host: one thread row by row (what
the mask worker does by default), K Python threads each taking a slice of the rows (each
row's library call releases the GIL), and llguidance's own pool of K threads (one call).

Why: with every request constrained, a step's masks cost ~45 us a row on the H200's host
(~11.5 ms for 256 rows, more than the forward), and llguidance's pool there was slower
than one thread (bench/RESULTS.md, 2026-12-04 evening). Whether plain threads over slices
scale on that host decides whether the worker should split a ticket.

    python bench/probes/mask_threads.py --rows 256 --threads 2,4,8 --repeats 15
    python bench/probes/mask_threads.py --smoke          # byte vocabulary, seconds
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from _common import machine_facts, save_json  # noqa: E402
from constrained import SCHEMA  # noqa: E402
from grammar_batch import pick, tokenizer  # noqa: E402

from omni_async.structured.grammar import GrammarCompiler  # noqa: E402


def one_thread(handles, masks: np.ndarray, words: int) -> None:
    for j, h in enumerate(handles):
        h.unsafe_compute_mask_ptr(masks[j].ctypes.data, words * 4)


def sliced(handles, masks: np.ndarray, words: int, k: int) -> None:
    """``k`` threads, thread i computing rows i, i+k, ... (started and joined per call, as
    a ticket's would be by a pool of waiting threads: a start costs about a wake-up)."""
    def run(i: int) -> None:
        for j in range(i, len(handles), k):
            handles[j].unsafe_compute_mask_ptr(masks[j].ctypes.data, words * 4)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(1, k)]
    for t in threads:
        t.start()
    run(0)
    for t in threads:
        t.join()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--threads", default="2,4,8")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--walk", type=int, default=40, help="tokens each matcher takes before the timing (spread states)")
    p.add_argument("--compilers", type=int, default=1,
                   help="grammar compilers: row j's matcher from compiler j %% N (thread slices take rows i, i+k, ...: "
                        "with N = k each thread's rows share one compiled grammar, and no two threads do)")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--tokenizer-dir", default=None, help="a folder with tokenizer.json (default: SmolLM2's GGUF)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.smoke:
        args.rows, args.repeats, args.walk, args.threads = 16, 3, 5, "2"
    tok, vocab = tokenizer(args.smoke, args.tokenizer_dir)
    compilers = [GrammarCompiler(tok, vocab) for _ in range(args.compilers)]
    key = ("json_schema", json.dumps(SCHEMA))
    matchers = [compilers[j % len(compilers)].matcher(key) for j in range(args.rows)]
    rng = np.random.default_rng(0)
    for i, m in enumerate(matchers):  # each row somewhere else in the schema
        for _ in range(int(rng.integers(0, args.walk + 1))):
            m.accept(pick(m.next_mask(), vocab, rng))
    handles = [m.handle for m in matchers]
    words = (vocab + 31) // 32
    ks = [int(k) for k in args.threads.split(",") if k]
    import llguidance

    pools = {k: llguidance.LLExecutor(num_threads=k) for k in ks}
    ways = {"one thread": lambda masks: one_thread(handles, masks, words)}
    for k in ks:
        ways[f"{k} threads, slices"] = lambda masks, k=k: sliced(handles, masks, words, k)
        ways[f"pool of {k}"] = lambda masks, k=k: pools[k].unsafe_compute_mask_ptr(
            [(h, j) for j, h in enumerate(handles)], masks.ctypes.data, words * 4, len(handles))
    reference = np.empty((len(handles), words), dtype=np.int32)
    one_thread(handles, reference, words)
    times: dict[str, list[float]] = {w: [] for w in ways}
    for r in range(args.repeats + 1):  # the first round warms up, then interleaved rounds
        order = list(ways) if r % 2 == 0 else list(reversed(ways))
        for way in order:
            masks = np.empty_like(reference)
            t0 = time.perf_counter()
            ways[way](masks)
            took = time.perf_counter() - t0
            assert np.array_equal(masks, reference), way  # every way computes the same masks
            if r:
                times[way].append(took)
    for compiler in compilers:
        compiler.close()
    base = statistics.median(times["one thread"])
    print(f"{len(handles)} rows, vocabulary {vocab}, {args.repeats} interleaved repeats; ms a step, median [min-max]")
    summary = {}
    for way, ts in times.items():
        med = statistics.median(ts)
        summary[way] = {"ms": 1e3 * med, "min_ms": 1e3 * min(ts), "max_ms": 1e3 * max(ts),
                        "us_per_row": 1e6 * med / len(handles), "speedup": base / med}
        print(f"  {way:20s} {1e3 * med:7.2f} [{1e3 * min(ts):.2f}-{1e3 * max(ts):.2f}]  "
              f"{1e6 * med / len(handles):6.1f} us a row  {base / med:5.2f}x")
    out = args.out or ("mask_threads_smoke.json" if args.smoke else "mask_threads.json")
    print(f"saved {save_json(out, {'machine': machine_facts(), 'args': vars(args), 'vocab': vocab, 'summary': summary})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
