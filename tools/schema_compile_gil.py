#!/usr/bin/env python
"""Whether compiling a large JSON schema holds the GIL, the way the grammar gate's thread
compiles it, against the way it was compiled before.

Why: the gate compiles on a thread of its own, so a compile stalls the event loop only for
the time it holds the GIL. ``before``: the schema as a Python dict through
``LLMatcher.grammar_from_json_schema`` (the library reads the dict with the GIL held), then
the matcher. ``after`` (structured/library.py): the schema text through
``llguidance.grammar_from``, read by the matcher's constructor, which releases the GIL.
A ticker thread (sleep 1 ms, record the overshoot) runs beside each compile; its worst gap
is the longest the compile kept it from running. ``idle`` is the ticker alone for as long
(the host's own noise). Shapes: a flat object of N optional integer properties, and of N
properties each an object of two required fields. The tiny model's vocabulary.

    python tools/schema_compile_gil.py --sizes 1000 5000 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # _common
import _common as C  # noqa: E402


def ticker_max_gap(work: Callable[[], Any]) -> tuple[float, float]:
    """(seconds ``work`` took, the ticker thread's worst gap meanwhile, in seconds)."""
    stop, gaps = threading.Event(), []

    def tick() -> None:
        prev = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - prev - 0.001)
            prev = now

    thread = threading.Thread(target=tick)
    thread.start()
    time.sleep(0.02)
    t0 = time.perf_counter()
    work()
    took = time.perf_counter() - t0
    stop.set()
    thread.join()
    return took, max(gaps)


def shapes(n: int) -> dict[str, dict[str, Any]]:
    flat = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}
    inner = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a", "b"]}
    nested = {"type": "object", "properties": {f"p{i}": inner for i in range(n)}}
    return {"flat": flat, "objects": nested}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[1000, 5000])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="schema_compile_gil.json")
    args = p.parse_args(argv)

    import llguidance

    from omni_async.structured.library import TokenizerView
    from omni_async.structured.library import JSON_DEFAULTS, parser_limits, with_json_defaults
    from omni_async.structured.vocab import token_vocab
    from omni_async.text.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    vocab = token_vocab(tok, tok.vocab_size)
    lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(TokenizerView(vocab)), n_vocab=vocab.size)
    limits = parser_limits(llguidance)

    def before(schema: dict[str, Any]) -> None:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
        llguidance.LLMatcher(lltok, grammar, log_level=0, limits=limits)

    def after(text: str) -> None:
        llguidance.LLMatcher(lltok, llguidance.grammar_from("json_schema", with_json_defaults(text)), log_level=0, limits=limits)

    rows = []
    for n in args.sizes:
        for shape, schema in shapes(n).items():
            text = json.dumps(schema, separators=(",", ":"))
            for rep in range(args.repeats):
                for arm, work in (("before", lambda: before(schema)), ("after", lambda: after(text))):
                    took, gap = ticker_max_gap(work)
                    _, idle = ticker_max_gap(lambda: time.sleep(took))
                    row = {"properties": n, "shape": shape, "repeat": rep, "arm": arm, "compile_ms": C.ms(took),
                           "worst_gap_ms": C.ms(gap), "idle_worst_gap_ms": C.ms(idle)}
                    rows.append(row)
                    print(row, flush=True)
    print(f"{'props':>6} {'shape':8} {'arm':7} {'compile ms':>10} {'worst gap ms':>12} {'idle gap ms':>11}")
    for n in args.sizes:
        for shape in ("flat", "objects"):
            for arm in ("before", "after"):
                mine = [r for r in rows if r["properties"] == n and r["shape"] == shape and r["arm"] == arm]
                med = lambda key: C.median_or_none(r[key] for r in mine)  # noqa: E731
                print(f"{n:>6} {shape:8} {arm:7} {C.fmt(med('compile_ms'), '.0f'):>10} {C.fmt(med('worst_gap_ms'), '.1f'):>12} "
                      f"{C.fmt(med('idle_worst_gap_ms'), '.1f'):>11}")
    print("saved", C.save_json(args.out, {"machine": C.machine_facts(), "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
