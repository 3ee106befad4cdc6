#!/usr/bin/env python
"""How a step's grammar masks scale over threads on this host: one thread row by row (what
the mask worker does by default), the worker's slice threads (``prefetch.SlicePool``: K
persistent threads, thread i taking rows i, i+K, ...; each row's library call releases the
GIL; ``OMNI_ASYNC_GRAMMAR_THREADS=K``), and llguidance's own pool of K threads (one call;
``OMNI_ASYNC_GRAMMAR_THREADS=pool:K``).

Why: with every request constrained, a step's masks cost ~45 us a row on the H200's host
(~11.5 ms for 256 rows, more than the forward), and llguidance's pool there was slower
than one thread (bench/RESULTS.md, 2026-12-04 evening). llguidance's copies of one compiled
grammar share its lexer behind one mutex held for a whole mask (``Parser::with_shared``),
so rows of one grammar cannot overlap: ``--compilers N`` gives row j a matcher of grammar
copy j % N (compiled apart, its own lexer), and with N = K each slice thread's rows share
one lexer and no two threads do. ``--compilers 1,8`` runs both. Per way: ms a step, and
CPU seconds over wall seconds (1.0: the threads did not overlap); then the time inside the
library calls per thread against one thread's share (the lock shows as a ratio near k
with one grammar copy and near 1 with k, on a host with k idle CPUs); then the mask worker
itself, one thread or slices, beside ``--busy-ms`` of pure Python on the calling thread
(the loop thread's part in the engine: each row's return needs the GIL it holds).

Its rows are the same states computed again and again: llguidance's mask at a state it has computed
before costs ~3.5x less than at a new one, the only kind the engine masks (``mask_cost.py --library``),
so its us a row are not the engine's (17 against 64 on the H200 host, 2026-12-05).

    python tools/mask_threads.py --rows 256 --threads 2,4,8 --compilers 1,8 --repeats 15
    python tools/mask_threads.py --smoke          # byte vocabulary, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # _common and the benchmarks
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's omni_async

from _common import machine_facts, save_json  # noqa: E402
from constrained import SCHEMA  # noqa: E402
from grammar_batch import busy, pick, tokenizer  # noqa: E402

from omni_async.structured.grammar import GrammarCompiler  # noqa: E402
from omni_async.structured.prefetch import MaskWorker, SlicePool, compute_slice  # noqa: E402


def one_thread(handles, masks: np.ndarray, words: int) -> None:
    """The worker's loop without slices (``prefetch.compute_slice`` over every row)."""
    compute_slice(handles, masks, np.ones(len(handles), dtype=bool), 0, 1)


def spread_handles(tok, vocab: int, rows: int, compilers: int, walk: int) -> tuple[list, list]:
    """``rows`` matchers of SCHEMA (row j's from grammar copy j % compilers), each a random
    number of allowed tokens in (spread positions); returns (handles, compilers)."""
    copies = [GrammarCompiler(tok, vocab) for _ in range(compilers)]
    key = ("json_schema", json.dumps(SCHEMA))
    matchers = [copies[j % len(copies)].matcher(key) for j in range(rows)]
    rng = np.random.default_rng(0)
    for m in matchers:
        for _ in range(int(rng.integers(0, walk + 1))):
            m.accept(pick(m.next_mask(), vocab, rng))
    return [m.handle for m in matchers], copies


def in_call_ms(handles: list, words: int, k: int, repeats: int) -> dict[str, float]:
    """Time spent inside the library calls, summed per thread, ``k`` threads over strided
    rows (started per round; the starts are outside the sums) against one thread's sum / k:
    a ratio well above 1 on a host with k idle CPUs means the calls waited for each other
    (one grammar's lexer lock) or for a CPU (a loaded host: look at the load)."""
    masks = np.empty((len(handles), words), dtype=np.int32)
    base, stride = masks.ctypes.data, words * 4

    def timed(first: int, step: int, out: list[float]) -> None:
        pc, total = time.perf_counter, 0.0
        for j in range(first, len(handles), step):
            t0 = pc()
            handles[j].unsafe_compute_mask_ptr(base + j * stride, stride)
            total += pc() - t0
        out.append(total)

    alone, per_thread = [], []
    for _ in range(repeats):
        out: list[float] = []
        timed(0, 1, out)
        alone.append(out[0] / k)
        sums: list[float] = []
        threads = [threading.Thread(target=timed, args=(i, k, sums)) for i in range(k)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        per_thread.append(statistics.median(sums))
    a, p = statistics.median(alone), statistics.median(per_thread)
    return {"alone_ms_per_share": 1e3 * a, "per_thread_ms": 1e3 * p, "ratio": p / a}


def beside_python(handles: list, words: int, ks: list[int], busy_ms: float,
                  repeats: int) -> dict[str, dict[str, float]]:
    """The engine's case: the mask worker (``MaskWorker``, one thread or ``k`` slices) gets
    the rows as one ticket while this thread, standing in for the loop, runs pure Python
    for ``busy_ms`` and then waits for the masks. Each row's return from the library needs
    the GIL that the busy thread holds (handed over every switch interval or when it
    blocks), so the worker's time here is mostly waiting; slices wait side by side."""
    workers = {"one thread": MaskWorker(words)}
    workers["one thread"].slices = None
    workers["one thread"].threads = 0
    for k in ks:
        w = MaskWorker(words)
        w.threads, w.slices = 0, SlicePool(k)
        workers[f"{k} threads, slices"] = w
    busy(20)
    alone = statistics.median(busy(busy_ms) for _ in range(10))
    runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in workers}
    for r in range(repeats + 1):
        order = list(workers) if r % 2 == 0 else list(reversed(workers))
        for name in order:
            w = workers[name]
            secs = w.seconds
            ticket = w.submit(handles)
            iters = busy(busy_ms)
            t0 = time.perf_counter()
            ticket.done.wait()
            wait = time.perf_counter() - t0
            if r:
                runs[name].append((1e3 * (w.seconds - secs), 1e3 * wait, iters / alone))
    for w in workers.values():
        w.close()
    return {name: {"worker_ms": statistics.median(x[0] for x in rs), "worker_min_ms": min(x[0] for x in rs),
                   "worker_max_ms": max(x[0] for x in rs),
                   "wait_after_busy_ms": statistics.median(x[1] for x in rs),
                   "busy_share": statistics.median(x[2] for x in rs)} for name, rs in runs.items()}


def measure(handles: list, vocab: int, ks: list[int], repeats: int) -> dict[str, dict[str, float]]:
    """Every way over ``repeats`` interleaved rounds after a warm-up round; masks checked
    equal to one thread's."""
    import llguidance

    words = (vocab + 31) // 32
    pools = {k: llguidance.LLExecutor(num_threads=k) for k in ks}
    slices = {k: SlicePool(k) for k in ks}
    ok = np.ones(len(handles), dtype=bool)
    ways = {"one thread": lambda masks: one_thread(handles, masks, words)}
    for k in ks:
        ways[f"{k} threads, slices"] = lambda masks, k=k: slices[k].run(handles, masks, ok)
        ways[f"pool of {k}"] = lambda masks, k=k: pools[k].unsafe_compute_mask_ptr(
            [(h, j) for j, h in enumerate(handles)], masks.ctypes.data, words * 4, len(handles))
    reference = np.empty((len(handles), words), dtype=np.int32)
    one_thread(handles, reference, words)
    times: dict[str, list[tuple[float, float]]] = {w: [] for w in ways}
    for r in range(repeats + 1):  # the first round warms up, then interleaved rounds
        order = list(ways) if r % 2 == 0 else list(reversed(ways))
        for way in order:
            masks = np.empty_like(reference)
            c0, t0 = time.process_time(), time.perf_counter()
            ways[way](masks)
            took, cpu = time.perf_counter() - t0, time.process_time() - c0
            assert ok.all() and np.array_equal(masks, reference), way  # every way computes the same masks
            if r:
                times[way].append((took, cpu))
    for pool in slices.values():
        pool.close()
    base = statistics.median(t for t, _ in times["one thread"])
    summary = {}
    for way, runs in times.items():
        ts = [t for t, _ in runs]
        med = statistics.median(ts)
        summary[way] = {"ms": 1e3 * med, "min_ms": 1e3 * min(ts), "max_ms": 1e3 * max(ts),
                        "us_per_row": 1e6 * med / len(handles), "speedup": base / med,
                        "cpu_over_wall": statistics.median(c / t for t, c in runs)}
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--threads", default="2,4,8")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--walk", type=int, default=40, help="tokens each matcher takes before the timing (spread states)")
    p.add_argument("--compilers", default="1",
                   help="comma-separated grammar copies: row j's matcher from copy j %% N (thread slices take rows "
                        "i, i+k, ...: with N = k each thread's rows share one compiled grammar, and no two threads do)")
    p.add_argument("--busy-ms", type=float, default=3.0,
                   help="the worker beside this much pure Python on the calling thread (0: skip that part)")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--tokenizer-dir", default=None, help="a folder with tokenizer.json (default: SmolLM2's GGUF)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.smoke:
        args.rows, args.repeats, args.walk, args.threads = 16, 3, 5, "2"
    tok, vocab = tokenizer(args.smoke, args.tokenizer_dir)
    ks = [int(k) for k in args.threads.split(",") if k]
    results = {}
    for n in [int(c) for c in str(args.compilers).split(",") if c]:
        handles, copies = spread_handles(tok, vocab, args.rows, n, args.walk)
        summary = measure(handles, vocab, ks, args.repeats)
        calls = {k: in_call_ms(handles, (vocab + 31) // 32, k, args.repeats) for k in ks}
        beside = beside_python(handles, (vocab + 31) // 32, ks, args.busy_ms, args.repeats) if args.busy_ms else {}
        for compiler in copies:
            compiler.close()
        print(f"{len(handles)} rows from {n} grammar cop{'y' if n == 1 else 'ies'}, vocabulary {vocab}, "
              f"{args.repeats} interleaved repeats; ms a step, median [min-max]")
        for way, f in summary.items():
            print(f"  {way:20s} {f['ms']:7.2f} [{f['min_ms']:.2f}-{f['max_ms']:.2f}]  {f['us_per_row']:6.1f} us a row  "
                  f"{f['speedup']:5.2f}x  cpu/wall {f['cpu_over_wall']:.2f}")
        for k, c in calls.items():
            print(f"  in the library calls, {k} threads: {c['per_thread_ms']:.2f} ms a thread against "
                  f"{c['alone_ms_per_share']:.2f} ms for its share alone ({c['ratio']:.2f}x)")
        if beside:
            print(f"  the worker beside {args.busy_ms} ms of pure Python on this thread (the loop), then the wait:")
        for name, b in beside.items():
            print(f"    {name:20s} worker {b['worker_ms']:6.2f} "
                  f"[{b['worker_min_ms']:.2f}-{b['worker_max_ms']:.2f}] ms, "
                  f"wait after the Python {b['wait_after_busy_ms']:.2f} ms, the Python's share of its work alone "
                  f"{b['busy_share']:.2f}")
        results[str(n)] = dict(summary, in_calls={str(k): c for k, c in calls.items()}, beside_python=beside)
    out = args.out or ("mask_threads_smoke.json" if args.smoke else "mask_threads.json")
    payload = {"machine": machine_facts(), "load": os.getloadavg(), "args": vars(args), "vocab": vocab,
               "by_compilers": results}
    print(f"saved {save_json(out, payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
