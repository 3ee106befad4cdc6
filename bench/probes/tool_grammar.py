"""What a forced tool call costs before its request is admitted: compiling its grammar.

``tool_choice="required"`` (or a named function) turns the request's tools into one grammar
of ``<tool_call>`` blocks, each function's ``parameters`` schema embedded
(``omni_async.server.tools.calls_grammar``); it compiles on the engine's grammar thread
before admission, once per distinct tool set (then cached). Measured here on SmolLM2's
vocabulary (49,152 tokens) through the engine's ``GrammarCompiler``: the cold compile time of
that grammar for 1, 4 and 16 tools, beside the cold compile of one function's arguments
schema alone (what ``response_format`` with that schema compiles). Each repeat uses fresh
function names, so every compile is cold; kinds alternate within a repeat. Medians and
spread printed and saved to bench/results/.

    python bench/probes/tool_grammar.py            # --repeats N
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _common and the benchmarks
from _common import machine_facts, save_json

PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}


def tools(count: int, tag: str) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": f"fn_{tag}_{i}", "parameters": PARAMETERS}} for i in range(count)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--counts", default="1,4,16")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="tool_grammar.json")
    args = ap.parse_args()
    from omni_async.models.gguf import GGUFFile, config_from_gguf, load_gguf_tokenizer, smollm2_path
    from omni_async.server.tools import calls_grammar
    from omni_async.structured.grammar import GrammarCompiler

    f = GGUFFile(smollm2_path())
    cfg = config_from_gguf(f)
    compiler = GrammarCompiler(load_gguf_tokenizer(f, cfg), cfg.vocab_size)
    t0 = time.perf_counter()
    compiler.compile(("json_schema", json.dumps({"type": "object"})))  # builds the tokenizer view once
    setup_s = time.perf_counter() - t0
    counts = [int(c) for c in args.counts.split(",")]
    times: dict[str, list[float]] = {"arguments_schema": [], **{f"tools_{c}": [] for c in counts}}
    for rep in range(args.repeats):
        keys = {"arguments_schema": ("json_schema", json.dumps({**PARAMETERS, "title": f"r{rep}"}))}
        keys.update({f"tools_{c}": ("ebnf", calls_grammar(tools(c, f"r{rep}"), several=True)) for c in counts})
        order = list(keys) if rep % 2 == 0 else list(keys)[::-1]
        for kind in order:
            t0 = time.perf_counter()
            compiler.compile(keys[kind])
            compiler.matcher(keys[kind])  # raises if it did not compile
            times[kind].append((time.perf_counter() - t0) * 1e3)
    summary = {
        kind: {"median_ms": statistics.median(v), "min_ms": min(v), "max_ms": max(v), "all_ms": v} for kind, v in times.items()
    }
    print(f"tokenizer view set-up (once per engine): {setup_s * 1e3:.0f} ms; vocab {cfg.vocab_size}")
    print(f"{'grammar':<18}{'median ms':>10}{'min':>8}{'max':>8}")
    for kind, s in summary.items():
        print(f"{kind:<18}{s['median_ms']:>10.2f}{s['min_ms']:>8.2f}{s['max_ms']:>8.2f}")
    path = save_json(args.out, {"machine": machine_facts(), "vocab_size": cfg.vocab_size, "setup_s": setup_s, "repeats": args.repeats, "compile": summary})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
