#!/usr/bin/env python
"""The mask worker fed row by row against one ticket per step, with the loop thread busy.

Why: on the H200 (2026-12-04, all 256 requests under bench/constrained.py's SCHEMA) the
worker took 112 us a row, one row after another, on a 16-core host: each matcher queued
its own next mask as the loop accepted its token, so the worker woke per row, computed it
in a Python loop and took the GIL back between rows while the loop thread ran Python.
This probe reproduces the step's host side without a model: ``--rows`` matchers walk
SCHEMA with random admissible tokens; each step, in turn for each way,
- "rows" (before): each matcher accepts its token and queues its own mask (a ticket of one),
- "step" (now): the matchers accept their tokens and the step's rows go as one ticket
  (``structured.grammar.prefetch_all``, what the batch core does),
then the loop thread runs ``--busy-ms`` of pure Python (its processing, emission and
scheduling of the step) and waits for every mask (the fill). Per step: the loop
thread's accept time, its wait at the fill, the worker's library calls and seconds, and
how much Python the busy spell got through (the GIL's share the worker left the loop).
``--threads N`` sizes llguidance's pool for the ticket (0: one thread; the engine uses
the pool only where OMNI_ASYNC_GRAMMAR_THREADS=pool:N asks for one, ``prefetch.pool_threads``;
the worker's own slice threads are ``tools/mask_threads.py``'s).

    python tools/grammar_batch.py --rows 128 --steps 40          # SmolLM2's vocabulary
    python tools/grammar_batch.py --smoke                         # byte vocabulary, seconds
    python tools/grammar_batch.py --tokenizer-dir /tmp/omni-bench-checkpoints/qwen05-smol
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # _common and the benchmarks
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's omni_async

from _common import machine_facts, save_json  # noqa: E402
from constrained import SCHEMA  # noqa: E402

from omni_async.structured.grammar import GrammarCompiler, prefetch_all  # noqa: E402
from omni_async.structured.prefetch import pool_threads  # noqa: E402


def tokenizer(smoke: bool, folder: str | None = None):
    """The byte tokenizer (smoke), a folder's tokenizer.json (e.g. bench/constrained.py's
    qwen05-smol checkpoint: SmolLM2's), or SmolLM2's GGUF."""
    if smoke:
        from omni_async.text.tokenizer import ByteTokenizer

        tok = ByteTokenizer()
        return tok, tok.vocab_size
    if folder is not None:
        from tokenizers import Tokenizer

        from omni_async.text.tokenizer import HFTokenizer

        path = Path(folder) / "tokenizer.json"
        backend = Tokenizer.from_file(str(path))
        eos = backend.token_to_id("<|im_end|>")  # SmolLM2's (llguidance needs an end token)
        return HFTokenizer(path, () if eos is None else (eos,), backend.get_vocab_size()), backend.get_vocab_size()
    from omni_async.models.gguf import GGUFFile, config_from_gguf, load_gguf_tokenizer, smollm2_path

    f = GGUFFile(smollm2_path())
    cfg = config_from_gguf(f)
    return load_gguf_tokenizer(f, cfg), cfg.vocab_size


def busy(ms: float) -> int:
    """Pure Python for ``ms``: the iterations it got through."""
    end = time.perf_counter() + ms / 1e3
    n = 0
    while time.perf_counter() < end:
        n += 1
    return n


def pick(mask: np.ndarray, vocab: int, rng: np.random.Generator) -> int:
    allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab])
    return int(rng.choice(allowed))


def step(way: str, matchers, tokens: list[int], busy_ms: float, worker) -> dict[str, float]:
    calls0, secs0 = worker.calls, worker.seconds
    t0 = time.perf_counter()
    if way == "rows":
        for m, t in zip(matchers, tokens):
            m.accept(t)
    else:
        later: list = []
        for m, t in zip(matchers, tokens):
            m.accept(t, later=later)
        prefetch_all(later)
    t1 = time.perf_counter()
    spins = busy(busy_ms)
    t2 = time.perf_counter()
    for m in matchers:
        m.next_mask()
    t3 = time.perf_counter()
    return {"accept_ms": 1e3 * (t1 - t0), "busy_iters": spins, "fill_wait_ms": 1e3 * (t3 - t2),
            "worker_calls": worker.calls - calls0, "worker_ms": 1e3 * (worker.seconds - secs0)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--busy-ms", type=float, default=2.0)
    p.add_argument("--threads", type=int, default=None, help="llguidance pool threads for a ticket (default: the engine's)")
    p.add_argument("--smoke", action="store_true", help="byte vocabulary, 32 rows, 10 steps")
    p.add_argument("--tokenizer-dir", default=None, help="a folder with tokenizer.json (default: SmolLM2's GGUF)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.smoke:
        args.rows, args.steps = min(args.rows, 32), min(args.steps, 10)
    tok, vocab = tokenizer(args.smoke, args.tokenizer_dir)
    compiler = GrammarCompiler(tok, vocab)
    worker = compiler.masks
    if args.threads is not None:
        worker.threads = args.threads
    key = ("json_schema", json.dumps(SCHEMA))
    matchers = [compiler.matcher(key) for _ in range(args.rows)]
    rng = np.random.default_rng(0)
    busy(50)  # warm
    base = statistics.median(busy(args.busy_ms) for _ in range(20))  # the busy spell alone
    per: dict[str, list[dict[str, float]]] = {"rows": [], "step": []}
    for s in range(args.steps):
        for way in (("rows", "step") if s % 2 == 0 else ("step", "rows")):
            tokens = [pick(m.next_mask(), vocab, rng) for m in matchers]
            per[way].append(step(way, matchers, tokens, args.busy_ms, worker))
    compiler.close()
    summary = {}
    for way, runs in per.items():
        summary[way] = {k: {"median": statistics.median(r[k] for r in runs), "min": min(r[k] for r in runs),
                            "max": max(r[k] for r in runs)} for k in runs[0]}
        summary[way]["busy_share"] = statistics.median(r["busy_iters"] for r in runs) / base
    print(f"{args.rows} rows, {args.steps} steps a way, vocabulary {vocab}, busy spell {args.busy_ms} ms "
          f"({base:.0f} iterations alone), pool threads {worker.threads} (engine default {pool_threads()})")
    print(f"{'way':5s} {'accept ms':>18s} {'fill wait ms':>20s} {'worker calls':>13s} {'worker ms':>20s} {'busy share':>10s}")
    for way, s in summary.items():
        def f(k: str, spec: str = ".2f") -> str:
            d = s[k]
            return f"{d['median']:{spec}} [{d['min']:{spec}}-{d['max']:{spec}}]"
        print(f"{way:5s} {f('accept_ms'):>18s} {f('fill_wait_ms'):>20s} {f('worker_calls', '.0f'):>13s} "
              f"{f('worker_ms'):>20s} {s['busy_share']:10.2f}")
    out = args.out or ("grammar_batch_smoke.json" if args.smoke else "grammar_batch.json")
    path = save_json(out, {"machine": machine_facts(), "args": vars(args), "vocab": vocab,
                           "busy_alone_iters": base, "summary": summary})
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
