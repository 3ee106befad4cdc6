"""Can llguidance compute many rows' masks of one JSON schema in parallel if the rows do not
share one compiled grammar? (issue 61, branch hostcost)

Why: on the null device (tools/constrained_host.py --decode-steps 8 --requests 256 --tokens
128) about half of an all-constrained token's host time with llguidance is the mask worker's
library calls (~13.5 of ~27 us: a mask at a position the grammar does not force ~38 us, a
forced-token query ~9 us), one row after the other, and the launching thread waits for them
between forwards. The engine gives every request under one schema a copy of one compiled
template (``GrammarMatcher`` via ``deep_copy``), and the copies share the template's lexer
behind one lock held for a whole mask (structured/prefetch.py, ``mask_threads``), so the
worker's slice threads cannot overlap them. Rows spread over N templates compiled apart
("lanes", each lane's rows on a thread of its own) share no lexer: whether they then scale
with threads is what this measures. This VM (2 vCPUs, ~1.2 of them free) cannot tell; a
16-core GPU host can.

Per thread count T: us per mask (wall over rows x positions) for one template with T threads
taking every T-th row, and T lanes with T threads; every mask is compared with the one-thread
run's (they must be equal: the grammar decides a mask, not the compilation).

    python tools/mask_lanes.py --threads 1,2,4,8 --rows 256 --positions 48
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))


def walks(template, rows: int, positions: int, vocab: int, words: int, seed: int) -> list[list[int]]:
    """Each row's tokens: a seeded walk under its masks (a forced position takes its token)."""
    rng = random.Random(seed)
    buf = np.empty(words, dtype=np.int32)
    out = []
    for _ in range(rows):
        m, seq = template.deep_copy(), []
        for _ in range(positions):
            m.unsafe_compute_mask_ptr(buf.ctypes.data, buf.nbytes)
            ok = np.flatnonzero(np.unpackbits(buf.view(np.uint8), bitorder="little")[:vocab])
            t = int(ok[rng.randrange(len(ok))])
            seq.append(t)
            m.consume_token(t)
        out.append(seq)
    return out


def timed(handles: list, lane_of: list[int], threads: int, seqs: list[list[int]], words: int) -> tuple[float, np.ndarray]:
    """Seconds the masks of every position took (each row's thread: ``lane_of[row] % threads``),
    and the last position's masks."""
    rows, positions = len(handles), len(seqs[0])
    masks = np.empty((rows, words), dtype=np.int32)
    base, stride = masks.ctypes.data, words * 4
    mine = [[j for j in range(rows) if lane_of[j] % threads == i] for i in range(threads)]
    total = 0.0
    every = []
    for p in range(positions):
        def work(i: int) -> None:
            for j in mine[i]:
                handles[j].unsafe_compute_mask_ptr(base + j * stride, stride)

        t0 = time.perf_counter()
        helpers = [threading.Thread(target=work, args=(i,)) for i in range(1, threads)]
        for t in helpers:
            t.start()
        work(0)
        for t in helpers:
            t.join()
        total += time.perf_counter() - t0
        every.append(masks.copy())
        for j in range(rows):
            handles[j].consume_token(seqs[j][p])
    return total, np.stack(every)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", default="1,2,4")
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--positions", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--checkpoint-dir", default="/tmp/omni-bench-checkpoints")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from constrained import SCHEMA, qwen05_smol
    from grammar_batch import tokenizer

    from omni_async.structured.grammar import GrammarCompiler

    path = qwen05_smol(Path(args.checkpoint_dir) / "small-smol", small=True)
    tok, vocab = tokenizer(False, str(path))
    words = (vocab + 31) // 32
    key = ("json_schema", json.dumps(SCHEMA))

    def template():  # a grammar compiled apart: its own lexer (GrammarCompiler's cache is per compiler)
        compiler = GrammarCompiler(tok, vocab, backend="llguidance")
        return compiler, compiler.matcher(key).handle

    keep, first = template()
    seqs = walks(first, args.rows, args.positions, vocab, words, seed=0)
    counts = [int(x) for x in args.threads.split(",")]
    results, reference = [], None
    for rep in range(args.repeats):
        for n in counts:
            for way in ("one template", "lanes"):
                if way == "lanes" and n == 1:
                    continue
                made = [template() for _ in range(n if way == "lanes" else 1)]
                lane_of = list(range(args.rows)) if way == "one template" else [j % n for j in range(args.rows)]
                handles = [made[lane_of[j] % len(made)][1].deep_copy() for j in range(args.rows)]
                secs, masks = timed(handles, lane_of, n, seqs, words)
                if reference is None:
                    reference = masks
                same = bool((masks == reference).all())
                us = 1e6 * secs / (args.rows * args.positions)
                results.append({"repeat": rep, "threads": n, "way": way, "us_per_mask": us, "same_masks": same})
                print(f"rep {rep} {way:13s} threads {n:2d}: {us:7.1f} us a mask (wall), masks equal {same}", flush=True)
                for compiler, _ in made:
                    compiler.close()
    keep.close()
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
