#!/usr/bin/env python
"""The mask cost per row and per step of llguidance and xgrammar, over threads, on the grammars
constrained requests bring: which library (or second backend) the masks should come from.

Why: an all-constrained batch spends its step waiting for masks (issue 61: 3.5 ms of fill a
step on the H100 for ~101 rows, llguidance's first mask at a parser state ~64 us a row on
that host). xgrammar precomputes token masks per grammar state at compile time; llguidance
computes them lazily. Which one is cheaper per row at batch, and whether threads help, is
this probe's question, asked the way the engine asks it:

- vocabulary: SmolLM2's 49,152 tokens through the engine's byte view
  (``omni_async.structured.vocab``), as ``bench/constrained.py``'s qwen05-smol model;
- grammars: ``bench/constrained.py``'s SCHEMA (an array of small objects, the bench's
  workload), a tool call (``{"name": one of 4 functions, "arguments": that function's
  schema}``, the body ``tool_choice="required"`` constrains) and a regex (phone numbers);
  JSON written with ", " and ": " and no other whitespace in both libraries;
- ``--rows`` matchers, copies of one compiled grammar (as the engine's requests with one
  schema are), walk their grammar with random admissible tokens (a random-weight model's
  walk): each step fills every row's mask (timed), then each row takes a token (its accept
  timed apart), a matcher that ends starting again. A warm-up walk runs first, untimed;
- threads: 1 is the plain loop on the calling thread for llguidance (the engine's mask
  worker) and a one-thread ``BatchGrammarMatcher`` for xgrammar; N > 1 is llguidance's
  ``LLExecutor(num_threads=N)`` and xgrammar's ``BatchGrammarMatcher(max_threads=N)``
  (``--threads``, default 1,4,15: the GPU host has 16 cores, one left to the loop).

Printed and saved (bench/results/grammar_libraries_threads.json): per library, grammar and threads,
the fill's time per row (step time / rows: mean and median over steps) and per step (median,
p90), the accept per row, the cold compile, and the CPU the process used over the fill
(CPU/wall above 1 means the threads did run at once). A library not installed is left out
(xgrammar: ``pip install --no-deps xgrammar apache-tvm-ffi`` on a CPU-only machine, where its
Triton requirement would put Triton where the CPU paths would find it).

    python tools/grammar_libraries.py                         # 128 rows, 96 steps after 32, threads 1,4,15
    python tools/grammar_libraries.py --rows 64 --steps 16 --threads 1,2   # a quick look
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import random
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # _common and the benchmarks
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's omni_async

from _common import machine_facts, save_json  # noqa: E402
from constrained import SCHEMA  # noqa: E402

TOOL_PARAMETERS = [
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                      "unit": {"enum": ["celsius", "fahrenheit"]},
                                      "days": {"type": "integer", "minimum": 1, "maximum": 14}},
     "required": ["city", "unit"], "additionalProperties": False},
    {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1, "maximum": 50}},
     "required": ["query"], "additionalProperties": False},
    {"type": "object", "properties": {"to": {"type": "string"}, "subject": {"type": "string", "maxLength": 80},
                                      "urgent": {"type": "boolean"}},
     "required": ["to", "subject", "urgent"], "additionalProperties": False},
    {"type": "object", "properties": {"ids": {"type": "array", "items": {"type": "integer"}, "maxItems": 8}},
     "required": ["ids"], "additionalProperties": False},
]
TOOL_CALL = {"anyOf": [
    {"type": "object", "properties": {"name": {"const": name}, "arguments": params},
     "required": ["name", "arguments"], "additionalProperties": False}
    for name, params in zip(("get_weather", "search", "send_mail", "fetch_records"), TOOL_PARAMETERS)
]}
REGEX = r"(\+[0-9]{1,3} )?\([0-9]{3}\) [0-9]{3}-[0-9]{4}( ext\. [0-9]{1,5})?"
GRAMMARS = {"schema": ("json_schema", json.dumps(SCHEMA)), "tool_call": ("json_schema", json.dumps(TOOL_CALL)),
            "regex": ("regex", REGEX)}


class LLGuidance:
    """llguidance as the engine builds it (``structured.grammar``: the same grammar text,
    JSON layout and parser limits)."""

    name = "llguidance"

    def setup(self, vocab: Any) -> None:
        import llguidance

        from omni_async.structured.library import TokenizerView
        self.llg = llguidance
        self.tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(TokenizerView(vocab)), n_vocab=vocab.size)
        self.executors: dict[int, Any] = {}

    def compile(self, kind: str, text: str) -> Any:
        from omni_async.structured.library import grammar_text
        from omni_async.structured.library import parser_limits

        m = self.llg.LLMatcher(self.tok, grammar_text(self.llg, kind, text), log_level=0, limits=parser_limits(self.llg))
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matchers: list[Any], bitmask: np.ndarray, threads: int) -> None:
        stride = bitmask.shape[1] * 4
        if threads <= 1:
            base = bitmask.ctypes.data
            for i, m in enumerate(matchers):
                m.unsafe_compute_mask_ptr(base + i * stride, stride)
            return
        ex = self.executors.get(threads)
        if ex is None:
            ex = self.executors[threads] = self.llg.LLExecutor(num_threads=threads)
        ex.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.ctypes.data, stride, bitmask.shape[0])

    def accept(self, m: Any, token: int) -> bool:
        return m.consume_token(token) and not m.is_error()

    def done(self, m: Any) -> bool:
        return m.is_stopped() or m.is_error()


class XGrammar:
    """xgrammar with the same vocabulary and JSON layout."""

    name = "xgrammar"

    def setup(self, vocab: Any) -> None:
        import xgrammar

        self.xgr = xgrammar
        self.info = xgrammar.TokenizerInfo(list(vocab.token_bytes), xgrammar.VocabType.RAW, vocab_size=vocab.size,
                                           stop_token_ids=list(vocab.eos_ids))
        self.batches: dict[int, Any] = {}

    def compile(self, kind: str, text: str) -> Any:
        c = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        if kind == "json_schema":  # the engine's grammar of the schema (structured/xgrammar_backend.py)
            from omni_async.structured.xgrammar_backend import json_ebnf

            return c.compile_grammar(json_ebnf(self.xgr, text))
        return c.compile_regex(text)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list[Any], bitmask: np.ndarray, threads: int) -> None:
        batch = self.batches.get(threads)
        if batch is None:
            batch = self.batches[threads] = self.xgr.BatchGrammarMatcher(max_threads=max(1, threads))
        import torch

        batch.batch_fill_next_token_bitmask(matchers, torch.from_numpy(bitmask))

    def accept(self, m: Any, token: int) -> bool:
        return m.accept_token(token)

    def done(self, m: Any) -> bool:
        return m.is_terminated()


def installed(dist: str) -> bool:
    try:
        md.version(dist)
        return True
    except md.PackageNotFoundError:
        print(f"{dist} is not installed: left out")
        return False


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def walk(lib: Any, compiled: Any, rows: int, steps: int, vocab: int, threads: int, seed: int) -> dict[str, Any]:
    """``steps`` fills of ``rows`` matchers taking random admissible tokens: each fill's
    seconds, the accepts' seconds, the CPU over the fills, and the rows left without an
    admissible token (0 unless a library's mask is wrong)."""
    rng = random.Random(seed)
    matchers = [lib.matcher(compiled) for _ in range(rows)]
    bitmask = np.zeros((rows, (vocab + 31) // 32), dtype=np.int32)
    fills, accepts, cpu, stuck = [], [], 0.0, 0
    for _ in range(steps):
        bitmask.fill(0)
        c0, t0 = cpu_seconds(), time.perf_counter()
        lib.fill(matchers, bitmask, threads)
        fills.append(time.perf_counter() - t0)
        cpu += cpu_seconds() - c0
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        picks = []
        for i in range(rows):
            allowed = np.flatnonzero(bits[i])
            picks.append(int(allowed[rng.randrange(len(allowed))]) if len(allowed) else -1)
        t0 = time.perf_counter()
        for i, token in enumerate(picks):
            m = matchers[i]
            if token < 0:
                stuck += 1
            if token < 0 or not lib.accept(m, token) or lib.done(m):
                matchers[i] = lib.matcher(compiled)
        accepts.append(time.perf_counter() - t0)
    return {"fill_s": fills, "accept_s": accepts, "cpu_s": cpu, "stuck_rows": stuck}


def summarise(run: dict[str, Any], rows: int) -> dict[str, Any]:
    fills = sorted(run["fill_s"])
    per_row = [1e6 * f / rows for f in run["fill_s"]]
    return {
        "us_per_row_mean": statistics.mean(per_row), "us_per_row_median": statistics.median(per_row),
        "ms_per_step_median": 1e3 * statistics.median(fills), "ms_per_step_p90": 1e3 * fills[(9 * len(fills)) // 10],
        "ms_per_step_mean": 1e3 * statistics.mean(fills),
        "accept_us_per_row": 1e6 * statistics.mean(run["accept_s"]) / rows,
        "cpu_per_wall": run["cpu_s"] / sum(run["fill_s"]) if sum(run["fill_s"]) else None,
        "stuck_rows": run["stuck_rows"], "steps": len(fills),
    }


def vocabulary() -> Any:
    from omni_async.models.gguf import GGUFFile, config_from_gguf, load_gguf_tokenizer, smollm2_path
    from omni_async.structured.vocab import token_vocab

    f = GGUFFile(smollm2_path())
    cfg = config_from_gguf(f)
    return token_vocab(load_gguf_tokenizer(f, cfg), cfg.vocab_size)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--steps", type=int, default=96, help="timed fills per library, grammar and threads")
    p.add_argument("--warmup", type=int, default=32, help="untimed fills first (the bench's warm-up arm)")
    p.add_argument("--threads", default="1,4,15")
    p.add_argument("--grammars", default=",".join(GRAMMARS))
    p.add_argument("--libraries", default="llguidance,xgrammar", help="run in this order (reverse it for a second run)")
    p.add_argument("--out", default="grammar_libraries_threads.json")
    args = p.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    grammars = [g for g in args.grammars.split(",") if g in GRAMMARS]
    vocab = vocabulary()
    known = {"llguidance": LLGuidance, "xgrammar": XGrammar}
    libs = [known[n]() for n in args.libraries.split(",") if n in known and installed(n)]  # in the order given
    report: dict[str, Any] = {"machine": machine_facts(), "vocab_size": vocab.size, "rows": args.rows, "steps": args.steps,
                              "warmup": args.warmup, "threads": threads, "libraries": {}}
    for lib in libs:
        t0 = time.perf_counter()
        lib.setup(vocab)
        entry: dict[str, Any] = {"version": md.version(lib.name), "setup_s": time.perf_counter() - t0, "grammars": {}}
        report["libraries"][lib.name] = entry
        for g in grammars:
            kind, text = GRAMMARS[g]
            t0 = time.perf_counter()
            compiled = lib.compile(kind, text)
            compile_ms = 1e3 * (time.perf_counter() - t0)
            walk(lib, compiled, args.rows, args.warmup, vocab.size, 1, seed=1)  # untimed
            by_threads = {}
            for i, n in enumerate(threads):
                s = summarise(walk(lib, compiled, args.rows, args.steps, vocab.size, n, seed=100 + i), args.rows)
                by_threads[str(n)] = s
                print(f"{lib.name:10s} {g:9s} threads {n:2d}: {s['us_per_row_mean']:7.1f} us/row mean "
                      f"({s['us_per_row_median']:6.1f} median), step {s['ms_per_step_median']:7.3f} ms median "
                      f"(p90 {s['ms_per_step_p90']:.3f}), accept {s['accept_us_per_row']:5.1f} us/row, "
                      f"CPU/wall {s['cpu_per_wall']:.2f}, stuck rows {s['stuck_rows']}", flush=True)
            entry["grammars"][g] = {"compile_ms": compile_ms, "threads": by_threads}
    path = save_json(args.out, report)
    print(f"\n{args.rows} rows a step, vocabulary {vocab.size}; us per row = step / rows; compile (cold, ms): "
          + "; ".join(f"{n} " + ", ".join(f"{g} {e['compile_ms']:.0f}" for g, e in r["grammars"].items())
                      for n, r in report["libraries"].items()))
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
