"""xgrammar against llguidance on our workloads: which grammar library constrained decoding uses.

Measured, both on the same byte vocabulary of SmolLM2's tokenizer (49,152 tokens, read
through ``omni_async.structured.vocab``): the one-off tokenizer set-up, the compile time of
a typical JSON schema, a regex and an EBNF grammar (cold: a fresh compiler per repeat), and
the host time to fill the next-token bitmask of a whole batch (16 and 64 rows by default)
while each row walks its grammar with random admissible tokens. Repeats alternate between
the libraries; medians and spread are printed and saved to bench/results/. llguidance's
mask fill is measured twice: through its thread pool and on one thread. A library that is
not installed is left out (the engine needs only llguidance; ``pip install xgrammar`` for
the comparison).

    python bench/probes/grammar_libraries.py            # --smoke: fewer steps and repeats
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _common and the benchmarks
from _common import machine_facts, save_json

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "active", "address"],
    "additionalProperties": False,
}
REGEX = r"(\+[0-9]{1,3} )?\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
EBNF = 'root ::= "answer: " ("yes" | "no" | [0-9]+) "."'


def package_size(names: list[str]) -> int:
    """Bytes on disk of the named distributions' files."""
    total = 0
    for name in names:
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        for f in dist.files or []:
            p = Path(dist.locate_file(f))
            if p.is_file():
                total += p.stat().st_size
    return total


class XGrammar:
    name = "xgrammar"
    deps = ["xgrammar", "apache-tvm-ffi", "triton"]  # triton comes with it on Linux x86-64

    def setup(self, vocab) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo(list(vocab.token_bytes), xgr.VocabType.RAW, vocab_size=vocab.size,
                                      stop_token_ids=list(vocab.eos_ids))
        self.batch = xgr.BatchGrammarMatcher(max_threads="auto")

    def compile(self, kind: str, text: str) -> Any:
        c = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        if kind == "json_schema":
            return c.compile_json_schema(text, any_whitespace=False)
        if kind == "regex":
            return c.compile_regex(text)
        return c.compile_grammar(text)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, m: Any, token: int) -> bool:
        return m.accept_token(token)

    def done(self, m: Any) -> bool:
        return m.is_terminated()


class LLGuidance:
    name = "llguidance"
    deps = ["llguidance"]

    def setup(self, vocab) -> None:
        import llguidance as llg

        self.llg = llg
        from omni_async.structured.grammar import _Wrapper  # the engine's own tokenizer view

        wrapper = _Wrapper(vocab)
        self.tok = llg.LLTokenizer(llg.TokenizerWrapper(wrapper), n_vocab=vocab.size)
        self.executor = llg.LLExecutor()

    def compile(self, kind: str, text: str) -> Any:
        llg = self.llg
        if kind == "json_schema":
            grammar = llg.grammar_from("json_schema", text)
        elif kind == "regex":
            grammar = llg.grammar_from("regex", text)
        else:
            from llguidance.gbnf_to_lark import gbnf_to_lark

            grammar = llg.grammar_from("lark", gbnf_to_lark(text))
        m = llg.LLMatcher(self.tok, grammar, log_level=0)  # compiling = building the first matcher
        if m.is_error():
            raise ValueError(m.get_error())
        return grammar, m

    def matcher(self, compiled: Any) -> Any:
        return compiled[1].deep_copy()

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        stride = bitmask.shape[1] * 4
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(), stride,
                                              bitmask.shape[0])

    def accept(self, m: Any, token: int) -> bool:
        return m.consume_token(token)

    def done(self, m: Any) -> bool:
        return m.is_stopped()


class LLGuidanceOneThread(LLGuidance):
    """llguidance filling row by row on the calling thread (what the engine does for few
    rows or few cores, omni_async.structured.batch_mask)."""

    name = "llguidance-1thread"

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        stride = bitmask.shape[1] * 4
        base = bitmask.data_ptr()
        for i, m in enumerate(matchers):
            m.unsafe_compute_mask_ptr(base + i * stride, stride)


def _installed(dist: str) -> bool:
    try:
        md.version(dist)
        return True
    except md.PackageNotFoundError:
        print(f"{dist} is not installed: left out (pip install {dist})")
        return False


def walk(lib, compiled, batch: int, steps: int, vocab_size: int, seed: int) -> list[float]:
    """Mask-fill times (s) of ``steps`` steps over ``batch`` rows taking random admissible tokens."""
    rng = random.Random(seed)
    matchers = [lib.matcher(compiled) for _ in range(batch)]
    bitmask = torch.zeros((batch, (vocab_size + 31) // 32), dtype=torch.int32)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        lib.fill(matchers, bitmask)
        times.append(time.perf_counter() - t0)
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
        for i, m in enumerate(matchers):
            allowed = np.flatnonzero(bits[i])
            token = int(allowed[rng.randrange(len(allowed))]) if len(allowed) else 0
            if not len(allowed) or not lib.accept(m, token) or lib.done(m):
                matchers[i] = lib.matcher(compiled)
    return times


def summary(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"mean_ms": statistics.mean(xs) * 1e3, "median_ms": statistics.median(xs) * 1e3, "p10_ms": xs[len(xs) // 10] * 1e3,
            "p90_ms": xs[(9 * len(xs)) // 10] * 1e3, "n": len(xs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="fewer steps and repeats")
    ap.add_argument("--out", default="grammar_libraries.json")
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.repeats = 16, 2
    from omni_async.models.gguf import GGUFFile, config_from_gguf, load_gguf_tokenizer, smollm2_path
    from omni_async.structured.vocab import token_vocab

    f = GGUFFile(smollm2_path())
    cfg = config_from_gguf(f)
    vocab = token_vocab(load_gguf_tokenizer(f, cfg), cfg.vocab_size)
    libs = [lib for lib in (XGrammar(), LLGuidance(), LLGuidanceOneThread()) if _installed(lib.deps[0])]
    report: dict[str, Any] = {"machine": machine_facts(), "vocab_size": vocab.size, "threads": torch.get_num_threads(),
                              "cpus": os.cpu_count(), "libraries": {}}
    for lib in libs:
        t0 = time.perf_counter()
        lib.setup(vocab)
        report["libraries"][lib.name] = {
            "version": md.version(lib.deps[0]), "setup_s": time.perf_counter() - t0,
            "install_mb": package_size(lib.deps) / 1e6, "deps_counted": lib.deps,
            "compile_ms": {}, "mask_ms": {},
        }
    grammars = {"json_schema": json.dumps(SCHEMA), "regex": REGEX, "ebnf": EBNF}
    compiled: dict[tuple[str, str], Any] = {}
    for rep in range(args.repeats):
        for lib in (libs if rep % 2 == 0 else libs[::-1]):
            for kind, text in grammars.items():
                t0 = time.perf_counter()
                compiled[lib.name, kind] = lib.compile(kind, text)
                report["libraries"][lib.name]["compile_ms"].setdefault(kind, []).append((time.perf_counter() - t0) * 1e3)
    batches = [int(b) for b in args.batches.split(",")]
    for rep in range(args.repeats):
        for lib in (libs if rep % 2 == 0 else libs[::-1]):
            for b in batches:
                times = walk(lib, compiled[lib.name, "json_schema"], b, args.steps, vocab.size, seed=rep)
                report["libraries"][lib.name]["mask_ms"].setdefault(str(b), []).extend(times)
    for name, r in report["libraries"].items():
        r["compile_ms"] = {k: summary([x / 1e3 for x in v]) for k, v in r["compile_ms"].items()}
        r["mask_ms"] = {k: summary(v) for k, v in r["mask_ms"].items()}
        print(f"{name} {r['version']}: set-up {r['setup_s']:.2f} s, install {r['install_mb']:.0f} MB")
        for k, s in r["compile_ms"].items():
            print(f"  compile {k:12s} median {s['median_ms']:8.2f} ms (p10 {s['p10_ms']:.2f}, p90 {s['p90_ms']:.2f})")
        for k, s in r["mask_ms"].items():
            print(f"  mask batch {k:>3s}      median {s['median_ms']:8.3f} ms (p10 {s['p10_ms']:.3f}, p90 {s['p90_ms']:.3f},"
                  f" mean {s['mean_ms']:.3f})")
    path = save_json(args.out, report)
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
