#!/usr/bin/env python
"""The cost of constrained decoding at equal work: NV256-style throughput with none, a
quarter and all of the requests under a JSON schema.

Workload (nano-vllm's bench.py, as in bench/RESULTS.md's NV256): Python ``random`` seeded 0;
``--requests`` prompts of ``randint(100, 1024)`` ids, each ``randint(0, 10000)``; per request
``max_new_tokens = randint(100, 1024)``; temperature 0.6 with a per-request seed;
``ignore_eos``; all submitted at once. Arms: "free" (no grammar), "quarter" (every fourth
request under SCHEMA, same prompt, same ``max_new_tokens``) and "all" (every request under
it). SCHEMA is a JSON array of at least 100,000 small objects: it cannot complete within any
request's length, so a constrained request runs exactly as many tokens as its free twin
(every arm does the same work; the old version of this bench let constrained requests stop
after ~34 tokens where their free twins ran ~500).

Every arm runs once to warm up (compiles, graph captures, the grammar's first masks), then
``--repeats`` interleaved repeats with the arms' order rotated; the prefix cache is flushed
before every run. Per run: output tok/s of the requests free in the free and quarter arms
(their tokens over the time the last of them finished), of all requests, the decode steps
and step time until the last free request finished and the decode steps after it
(constrained rows that fell behind, alone: a run's decode steps are not its free rows'), the
constrained outputs' validity (every complete array item parses and matches the item schema, and the
request ran to its length), and from the engine's counters: the host time the launching
thread spent filling masks per masked step and as % of a step (on CUDA a decode step is
launched on the loop thread, so this is the loop's time; on CPU the launch runs on the
worker thread), the mask worker's time, the rows whose mask was not computed ahead, the
positions the grammar forced (exactly one admissible token), fused launches holding
constrained rows (and beside them, split off: rows asking for logprobs), lookahead steps,
and jump-forward's counters: runs of forced tokens appended at once, the tokens they
skipped (as a share of the constrained rows' tokens: "skipped %"), and the one-forward
steps that computed them as extend rows. ``--no-jump-forward`` decodes forced tokens one by
one (the engine's ``jump_forward=False``), for comparison; ``--optimistic off`` masks every
constrained token first (the engine's ``optimistic_grammar=False``). The table: medians with [min-max] over repeats, and
the median paired ratios quarter/free (free rows) and all/free (all rows).

Model: ``--model qwen05-smol`` (default on CUDA) is the NV256 shape (Qwen2-0.5B, bf16,
random weights) with SmolLM2's vocabulary and tokenizer, a grammar needing a tokenizer;
``smollm2`` is the real SmolLM2-135M-Instruct; ``tiny`` the built-in model (CPU default).

    python bench/constrained.py --smoke                     # CPU, tiny, a few minutes (all loops)
    python bench/constrained.py --device cuda               # the H200 run (overlap loop)
    python bench/constrained.py --device cuda --arms free,all [--mask-pool on]   # all-constrained only, ~3 min
    python bench/constrained.py --device cuda --arms free,all --mask-threads 8 [--schemas 8]  # 8 slice threads
    python bench/constrained.py --device cuda --arms free,quarter,all --jump-forward   # forced runs appended, ~5 min
    python bench/constrained.py --device cuda --grammar-backend xgrammar   # the schema's masks from xgrammar
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common as C  # noqa: E402

from omni_async import Engine, SamplingParams  # noqa: E402

ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "active"],
    "additionalProperties": False,
}
# More items than any request can write: the grammar never completes, so a constrained
# request ends at its length like its free twin.
SCHEMA = {"type": "array", "items": ITEM, "minItems": 100_000}
ARMS = ("free", "quarter", "all")
SMOL_MODELS = ("qwen05-smol", "small-smol")  # random weights, SmolLM2's vocabulary (qwen05_smol)
COUNTERS = ("grammar_mask_steps", "grammar_mask_rows", "grammar_mask_s", "grammar_mask_inline_rows",
            "grammar_mask_prefetched_rows", "grammar_mask_worker_s", "grammar_forced_masks", "steps",
            "decode_steps", "lookahead_steps", "fused_decode_launches", "fused_decode_beside_grammar",
            "fused_decode_with_grammar", "grammar_jumps", "grammar_forced_skipped", "grammar_jump_steps",
            "grammar_mask_worker_calls", "grammar_mask_fused_steps", "grammar_mask_fused_s",
            "grammar_mask_sliced_calls",
            "fused_decode_late_captures", "grammar_late_mask_steps", "grammar_late_mask_s",
            "grammar_optimistic_tokens", "grammar_optimistic_refused",
            "grammar_between_forwards", "grammar_between_rows", "grammar_between_s")


def valid_item(obj: Any) -> bool:
    props = ITEM["properties"]
    return (
        isinstance(obj, dict) and set(obj) == set(props)
        and isinstance(obj["name"], str) and len(obj["name"]) <= 12
        and isinstance(obj["age"], int) and not isinstance(obj["age"], bool) and 0 <= obj["age"] <= 150
        and obj["role"] in props["role"]["enum"] and isinstance(obj["active"], bool)
    )


def valid_prefix(text: str) -> tuple[bool, int, str | None]:
    """Whether ``text`` is the start of an array of valid items (every complete item
    valid; what follows the last one is where the length cut it), the complete items, and
    the first thing refused (an item, or what stands where ", " should), else None.

    The length may cut anywhere, also inside the separator: ``...},`` (the "," and the
    " " are often tokens of their own) is a valid start. ``len`` counts code points, as
    JSON Schema's ``maxLength`` does."""
    if not text.startswith("["):
        return False, 0, text[:40]
    decoder, pos, items = json.JSONDecoder(), 1, 0
    while True:
        try:
            obj, end = decoder.raw_decode(text, pos)
        except ValueError:
            return True, items, None  # the item the length cut
        if not valid_item(obj):
            return False, items, text[pos:end]
        items += 1
        sep = text[end:end + 2]
        if sep != ", ":
            ok = ", ".startswith(sep) and end + len(sep) == len(text)  # cut in the separator
            return ok, items, None if ok else text[end:end + 40]
        pos = end + 2


class GrammarReplay:
    """Each constrained output's token ids fed again to a fresh matcher of SCHEMA. Tells the
    two kinds of fault apart: a token the grammar refuses is the engine's (a mask on the
    wrong row, a stale mask, a wrong forced token); ids the grammar accepts whose text the
    checker refuses are the grammar's, the detokenizer's or the checker's. The matcher is
    the engine's library's (``backend``): on a BPE vocabulary llguidance admits only the
    canonical tokens of text the grammar forces where xgrammar admits any split of it, so
    llguidance refuses ids xgrammar rightly produced."""

    def __init__(self, tokenizer: Any, backend: str | None = None) -> None:
        from omni_async.structured.grammar import GrammarCompiler

        self._compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, backend=backend)
        self._key = ("json_schema", json.dumps(SCHEMA))

    def accepts(self, ids: list[int]) -> bool:
        matcher = self._compiler.matcher(self._key).handle
        return all(matcher.consume_token(t) for t in ids) and not matcher.is_error()

    def close(self) -> None:
        self._compiler.close()


def workload(n: int, vocab: int, smoke: bool, seed: int = 0,
             lengths: tuple[int, int] | None = None) -> list[tuple[list[int], int]]:
    """``n`` (prompt ids, max_new_tokens), both lengths drawn from ``lengths`` (NV256's
    100-1024 by default, 16-48 with ``smoke``)."""
    rng = random.Random(seed)
    lo, hi = lengths or ((16, 48) if smoke else (100, 1024))
    prompts = [[rng.randint(0, 10000) % vocab for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    return [(p, rng.randint(lo, hi)) for p in prompts]


def constrained(arm: str, i: int) -> bool:
    return arm == "all" or (arm == "quarter" and i % 4 == 3)


def schema_for(i: int, schemas: int) -> dict[str, Any]:
    """Request ``i``'s schema: SCHEMA itself, or with ``schemas`` > 1 one of that many
    variants (minItems apart, never reached: the same outputs are valid) compiled apart. The
    engine gives the requests of one schema copies of one compiled grammar, whose masks
    llguidance computes one at a time (a lock on the grammar's lexer): variants are what
    the mask worker's threads could overlap (structured/prefetch.py, ``mask_threads``)."""
    return SCHEMA if schemas <= 1 else dict(SCHEMA, minItems=SCHEMA["minItems"] + i % schemas)


def requests(work, arm: str, schemas: int = 1) -> list[SamplingParams]:
    return [
        SamplingParams(max_new_tokens=new, temperature=0.6, seed=i, ignore_eos=True,
                       json_schema=schema_for(i, schemas) if constrained(arm, i) else None)
        for i, (_, new) in enumerate(work)
    ]


async def run_arm(engine: Engine, work, arm: str, replay: GrammarReplay, schemas: int = 1) -> dict[str, Any]:
    reqs = requests(work, arm, schemas)
    await engine.flush_cache()  # every run prefills its prompts (repeats would hit the cache)
    info0 = engine.scheduler.info()
    t0 = time.perf_counter()
    done: list[float] = [0.0] * len(reqs)
    free = [i for i in range(len(reqs)) if i % 4 != 3]  # free in the free and quarter arms
    free_set = set(free)
    free_left = [len(free) if arm != "all" else 0]
    at_free_end: dict[str, Any] = {}  # the counters when the last free request finished

    async def one(i: int) -> Any:
        r = await engine.generate(input_ids=work[i][0], sampling=reqs[i])
        done[i] = time.perf_counter() - t0
        if free_left[0] and i in free_set:
            free_left[0] -= 1
            if not free_left[0]:
                at_free_end.update(engine.scheduler.info())
        return r

    results = await asyncio.gather(*[one(i) for i in range(len(reqs))])
    info1 = engine.scheduler.info()
    d = {k: info1.get(k, 0) - info0.get(k, 0) for k in COUNTERS}
    window = free_window(info0, at_free_end, d, max(done[i] for i in free)) if at_free_end else None
    cons = [i for i in range(len(reqs)) if constrained(arm, i)]
    checks = [valid_prefix(results[i].text) for i in cons]
    accepted = [replay.accepts(results[i].output_ids) for i in cons]
    wall = max(done)
    masked = d["grammar_mask_steps"]
    step_ms = 1e3 * wall / d["steps"] if d["steps"] else None
    mask_ms = 1e3 * d["grammar_mask_s"] / masked if masked else None
    return {
        "arm": arm,
        "free_tok_s": sum(len(results[i].output_ids) for i in free) / max(done[i] for i in free) if arm != "all" else None,
        "total_tok_s": sum(len(r.output_ids) for r in results) / wall,
        "wall_s": wall,
        "tokens": sum(len(r.output_ids) for r in results),
        "equal_lengths": all(len(r.output_ids) == work[i][1] for i, r in enumerate(results)),
        "constrained": len(cons),
        "valid": sum(ok and results[i].finish_reason == "length" for (ok, _, _), i in zip(checks, cons)),
        "grammar_accepted": sum(accepted),
        "items_mean": statistics.mean(n for _, n, _ in checks) if checks else None,
        # the refused item itself (or what stood where ", " should), and the output's end
        "invalid_examples": [{"refused": bad, "items_before": n, "grammar_accepted": acc, "tail": results[i].text[-200:]}
                             for (ok, n, bad), acc, i in zip(checks, accepted, cons) if not ok or not acc][:3],
        "step_ms": step_ms,
        "mask_ms_per_step": mask_ms,
        "mask_pct_of_step": 100 * mask_ms / step_ms if mask_ms is not None and step_ms else None,
        "worker_ms_per_step": 1e3 * d["grammar_mask_worker_s"] / masked if masked else None,
        "mask_rows_per_step": d["grammar_mask_rows"] / masked if masked else None,
        # the worker's library calls (one per processed step's rows, plus admissions) and
        # the rows a call computed; the fill's time in fused launches, whose free rows wait too
        "worker_calls_per_step": d["grammar_mask_worker_calls"] / masked if masked else None,
        "worker_rows_per_call": (d["grammar_mask_prefetched_rows"] / d["grammar_mask_worker_calls"]
                                 if d["grammar_mask_worker_calls"] else None),
        "fused_fill_ms": (1e3 * d["grammar_mask_fused_s"] / d["grammar_mask_fused_steps"]
                          if d["grammar_mask_fused_steps"] else None),
        # steps whose masks were filled after the step before was processed, the forward
        # already enqueued (late masks), and what their fills took on the launching thread
        "late_pct_of_decode_steps": 100 * d["grammar_late_mask_steps"] / d["decode_steps"] if d["decode_steps"] else None,
        "late_fill_ms": (1e3 * d["grammar_late_mask_s"] / d["grammar_late_mask_steps"]
                         if d["grammar_late_mask_steps"] else None),
        # tokens a masked row sampled per decode step it was in: the step's first forward,
        # and the forwards after it under masks computed between them (core.multi_step.between_steps)
        "masked_tokens_per_step": ((d["grammar_mask_rows"] + d["grammar_between_rows"]) / d["grammar_mask_rows"]
                                   if d["grammar_mask_rows"] else None),
        "between_ms_per_forward": (1e3 * d["grammar_between_s"] / d["grammar_between_forwards"]
                                   if d["grammar_between_forwards"] else None),
        "grammar_backend": info1.get("grammar_backend"),  # the library asked for, and the grammars xgrammar compiled
        "xgrammar_compiles": info1.get("grammar_xgrammar_compiles"),
        "mask_threads": info1.get("grammar_mask_threads"),
        "mask_slices": info1.get("grammar_mask_slices"),  # the worker's slice threads (0: none)
        "sliced_calls": d["grammar_mask_sliced_calls"],  # worker calls split over its slice threads
        "inline_rows": d["grammar_mask_inline_rows"],
        # forced masks over the constrained rows' tokens (a jump-forward computes some masks
        # on the loop thread, so the worker's rows are no longer every position)
        "forced_pct": 100 * d["grammar_forced_masks"] / sum(len(results[i].output_ids) for i in cons) if cons else None,
        "skipped_pct": 100 * d["grammar_forced_skipped"] / sum(len(results[i].output_ids) for i in cons) if cons else None,
        "counters": d,
        "free_window": window,
        "free_outputs": [results[i].output_ids for i in free] if arm != "all" else None,
    }


# Counters split at the free rows' end (:func:`free_window`).
WINDOW = ("steps", "decode_steps", "fused_decode_launches", "fused_decode_with_grammar", "grammar_between_forwards",
          "grammar_late_mask_steps")


def free_window(info0: dict[str, Any], at_end: dict[str, Any], run: dict[str, Any], seconds: float) -> dict[str, Any]:
    """The run's counters up to the moment its last free request finished (``at_end``, the
    engine's ``info()`` then; ``info0`` before the run, ``run`` the whole run's), the
    window of the free rows' tok/s, and after it ("tail_"): constrained rows that fell
    behind (a masked row samples one token of a fused launch, where a free row samples k)
    run on alone, so a run's decode steps are not the steps its free rows took. The step
    time in the window (``step_ms``) is the one to compare with the free arm's. (A
    lookahead loop may have launched the step after the last free row's: +-1 step.)"""
    out: dict[str, Any] = {k: at_end.get(k, 0) - info0.get(k, 0) for k in WINDOW}
    out.update({f"tail_{k}": run.get(k, 0) - out[k] for k in WINDOW})
    out["step_ms"] = 1e3 * seconds / out["steps"] if out["steps"] else None
    return out


def qwen05_smol(folder: Path, small: bool = False) -> Path:
    """NV256's model shape with SmolLM2's 49,152-token vocabulary and tokenizer (random weights);
    ``small``: SMALL's, float32, on the CPU: the GPU run's ignored grammar at a CPU forward's cost."""
    import torch
    from gpu_suite import QWEN05, SMALL, make_checkpoint

    from omni_async.models.gguf import GGUFFile, config_from_gguf, load_gguf_tokenizer, smollm2_path

    shape = dict(SMALL if small else QWEN05, vocab_size=49152)
    path = make_checkpoint(folder, shape, dtype=torch.float32, device="cpu") if small else make_checkpoint(folder, shape)
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if not (path / "tokenizer.json").exists():
        saved = os.environ.get("OMNI_BENCH_SMOLLM2_TOKENIZER")  # a tokenizer.json saved from the GGUF before
        if saved:
            shutil.copyfile(saved, path / "tokenizer.json")
        else:
            f = GGUFFile(smollm2_path())
            tok = load_gguf_tokenizer(f, config_from_gguf(f))
            tok.backend.save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": "<|im_start|>"}))
        cfg["eos_token_id"] = 2
        cfg_path.write_text(json.dumps(cfg, indent=2))
    return path


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    model = args.model or ("qwen05-smol" if args.device == "cuda" else "tiny")
    if args.mask_pool != "default":  # llguidance's pool for the masks (structured/prefetch.py; off by default)
        pool = f"pool:{max(2, (os.cpu_count() or 2) - 1)}"
        os.environ["OMNI_ASYNC_GRAMMAR_THREADS"] = "0" if args.mask_pool == "off" else pool
    if args.mask_threads is not None:  # the variable's value as given (prefetch.mask_threads: N slices, pool:N)
        os.environ["OMNI_ASYNC_GRAMMAR_THREADS"] = args.mask_threads
    if args.grammar_backend != "default":  # structured/xgrammar_backend.py: the schema's masks from xgrammar
        os.environ["OMNI_ASYNC_GRAMMAR_BACKEND"] = args.grammar_backend
    path = str(qwen05_smol(Path(args.checkpoint_dir) / model, small=model == "small-smol")) if model in SMOL_MODELS else model
    kwargs: dict[str, Any] = {"device": args.device}
    if args.device == "cuda":
        kwargs.update(dtype="bfloat16", max_running_requests=args.max_running)
    if args.decode_steps is not None:
        kwargs["decode_steps"] = args.decode_steps
    if args.no_jump_forward or args.jump_forward:
        kwargs["jump_forward"] = bool(args.jump_forward)
    if args.optimistic != "default":  # rows sampling first, checked after (structured/optimistic.py; on by default)
        kwargs["optimistic_grammar"] = args.optimistic == "on"
    result: dict[str, Any] = {"machine": C.machine_facts(), "args": vars(args), "model": model, "runs": {}}
    for loop in C.parse_loops(args.loops):
        engine = await Engine.load(path, loop=loop, **kwargs)
        runs = []
        replay = GrammarReplay(engine.tokenizer, engine.scheduler.info().get("grammar_backend"))
        async with engine:
            lengths = tuple(C.parse_int_list(args.lengths)) if args.lengths else None
            work = workload(args.requests, engine.tokenizer.vocab_size, args.smoke, args.seed, lengths)
            arms = args.arms
            for arm in arms:  # warm-up: each arm once, not recorded
                await run_arm(engine, work, arm, replay, args.schemas)
            for rep in range(args.repeats):
                order = arms[rep % len(arms):] + arms[:rep % len(arms)]
                for arm in order:
                    run = dict(await run_arm(engine, work, arm, replay, args.schemas), repeat=rep)
                    runs.append(run)
                    print(f"{loop} rep {rep} {arm:8s} total {run['total_tok_s']:8.0f} tok/s"
                          + (f", free rows {run['free_tok_s']:8.0f} tok/s" if run["free_tok_s"] else "")
                          + (f", valid {run['valid']}/{run['constrained']} (grammar accepts {run['grammar_accepted']}), mask {run['mask_pct_of_step']:.1f}% of a step"
                             if run["constrained"] else "")
                          + (window_text(run) if run["free_window"] else ""), flush=True)
        replay.close()
        free_arm = next((r["free_outputs"] for r in runs if r["arm"] == "free"), None)
        for run in runs:  # the free rows' tokens: the same in every free and quarter run?
            run["free_same_as_free_arm"] = None if run["free_outputs"] is None or free_arm is None else run["free_outputs"] == free_arm
        for run in runs:
            run.pop("free_outputs")
        result["runs"][loop] = runs
    return result


def window_text(run: dict[str, Any]) -> str:
    w = run["free_window"]
    return (f"; decode steps {run['counters']['decode_steps']}: {w['decode_steps']} until the last free row "
            f"({w['fused_decode_launches']} fused, {w['grammar_between_forwards']} forwards under masks between), "
            f"{w['tail_decode_steps']} after it; step {w['step_ms'] or 0:.2f} ms until then")


def span(xs: list[float], fmt: str = "{:.0f}") -> str:
    if not xs:
        return "-"
    return f"{fmt.format(statistics.median(xs))} [{fmt.format(min(xs))}-{fmt.format(max(xs))}]"


def print_table(result: dict[str, Any]) -> None:
    print(f"\nmodel {result['model']}; medians [min-max] over repeats; ratios are medians of paired runs")
    head = (f"{'loop':13s} {'free arm tok/s':>22s} {'quarter: free rows':>22s} {'ratio':>6s} {'all-constrained':>22s} "
            f"{'ratio':>6s} {'valid':>9s} {'mask % step':>16s} {'forced %':>8s} {'skipped %':>9s} {'same':>5s}")
    print(head)
    for loop, runs in result["runs"].items():
        by = {a: [r for r in runs if r["arm"] == a] for a in ARMS}
        q_ratio = [q["free_tok_s"] / f["free_tok_s"] for q, f in zip(by["quarter"], by["free"])]
        a_ratio = [a["total_tok_s"] / f["total_tok_s"] for a, f in zip(by["all"], by["free"])]
        cons = by["quarter"] + by["all"]
        valid = f"{sum(r['valid'] for r in cons)}/{sum(r['constrained'] for r in cons)}"
        masks = [r["mask_pct_of_step"] for r in cons if r["mask_pct_of_step"] is not None]
        forced = [r["forced_pct"] for r in cons if r["forced_pct"] is not None]
        skipped = [r["skipped_pct"] for r in cons if r["skipped_pct"] is not None]
        same = all(r["free_same_as_free_arm"] for r in by["quarter"])
        print(f"{loop:13s} {span([r['free_tok_s'] for r in by['free']]):>22s} {span([r['free_tok_s'] for r in by['quarter']]):>22s} "
              f"{statistics.median(q_ratio) if q_ratio else 0:6.3f} {span([r['total_tok_s'] for r in by['all']]):>22s} "
              f"{statistics.median(a_ratio) if a_ratio else 0:6.3f} {valid:>9s} {span(masks, '{:.1f}'):>16s} "
              f"{statistics.median(forced) if forced else 0:8.1f} {statistics.median(skipped) if skipped else 0:9.1f} {str(same):>5s}")
        fw, qw = ([r["free_window"] for r in by[a] if r.get("free_window")] for a in ("free", "quarter"))
        if fw and qw:  # the free rows' steps, apart from the constrained rows' steps after them (free_window)
            print(f"  until the last free row: decode steps free arm {span([w['decode_steps'] for w in fw])}, quarter "
                  f"{span([w['decode_steps'] for w in qw])} (then {span([w['tail_decode_steps'] for w in qw])} more, "
                  f"constrained rows alone); step {span([w['step_ms'] for w in fw], '{:.2f}')} ms, quarter "
                  f"{span([w['step_ms'] for w in qw], '{:.2f}')} ms; quarter's forwards under masks between "
                  f"{span([w['grammar_between_forwards'] for w in qw])}, fused launches "
                  f"{span([w['fused_decode_launches'] for w in qw])} (free arm {span([w['fused_decode_launches'] for w in fw])})")
        for arm in ("quarter", "all"):
            rs = by[arm]
            if rs:
                print(f"  {arm:8s} per masked step: fill {span([r['mask_ms_per_step'] for r in rs], '{:.3f}')} ms on the launching "
                      f"thread, worker {span([r['worker_ms_per_step'] for r in rs], '{:.3f}')} ms, "
                      f"{statistics.median(r['mask_rows_per_step'] for r in rs):.1f} rows; step "
                      f"{span([r['step_ms'] for r in rs], '{:.2f}')} ms; rows not computed ahead "
                      f"{sum(r['inline_rows'] for r in rs)}; worker calls per masked step "
                      f"{span([r['worker_calls_per_step'] for r in rs if r['worker_calls_per_step'] is not None], '{:.2f}')} "
                      f"({span([r['worker_rows_per_call'] for r in rs if r['worker_rows_per_call'] is not None], '{:.1f}')} rows a call, "
                      f"pool threads {rs[0]['mask_threads']}, slice threads {rs[0]['mask_slices']}; grammar library "
                      f"{rs[0]['grammar_backend']}, xgrammar compiles {rs[0]['xgrammar_compiles']}); fill per fused launch "
                      f"{span([r['fused_fill_ms'] for r in rs if r['fused_fill_ms'] is not None], '{:.3f}')} ms; "
                      f"fused launches with grammar rows "
                      f"{sum(r['counters']['fused_decode_with_grammar'] for r in rs)} (beside, split off: "
                      f"{sum(r['counters']['fused_decode_beside_grammar'] for r in rs)}; graphs captured in the runs: "
                      f"{sum(r['counters']['fused_decode_late_captures'] for r in rs)}); jump-forwards "
                      f"{sum(r['counters']['grammar_jumps'] for r in rs)}, forced tokens skipped "
                      f"{sum(r['counters']['grammar_forced_skipped'] for r in rs)}, jump steps "
                      f"{sum(r['counters']['grammar_jump_steps'] for r in rs)}; late-mask steps "
                      f"{span([r['late_pct_of_decode_steps'] for r in rs if r['late_pct_of_decode_steps'] is not None], '{:.0f}')} % "
                      f"of decode steps, their fill {span([r['late_fill_ms'] for r in rs if r['late_fill_ms'] is not None], '{:.3f}')} ms; "
                      f"masked rows' tokens a step {span([r['masked_tokens_per_step'] for r in rs if r.get('masked_tokens_per_step') is not None], '{:.2f}')}, "
                      f"masks between forwards {span([r['between_ms_per_forward'] for r in rs if r.get('between_ms_per_forward') is not None], '{:.3f}')} ms a forward; "
                      f"grammar accepts {sum(r['grammar_accepted'] for r in rs)}"
                      f"/{sum(r['constrained'] for r in rs)} outputs' ids; equal lengths "
                      f"{all(r['equal_lengths'] for r in rs)}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="'qwen05-smol' (CUDA default), 'small-smol' (its vocabulary, a small random "
                   "model on the CPU), 'smollm2', 'tiny' (CPU default) or a folder")
    p.add_argument("--device", default="cpu")
    p.add_argument("--loops", default=None, help="default: overlap on CUDA, all three on CPU")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of free,quarter,all (default all three; "
                   "'free,all' for the all-constrained ratio in two thirds of the time)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 3; 1 with --smoke)")
    p.add_argument("--decode-steps", type=int, default=None, help="forwards per decode step (default: the engine's)")
    p.add_argument("--max-running", type=int, default=256, help="max_running_requests on CUDA")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mask-pool", choices=("default", "off", "on"), default="default",
                   help="llguidance's thread pool for the masks: as the environment says (off unless "
                        "OMNI_ASYNC_GRAMMAR_THREADS), off (one thread), or on (every CPU but one)")
    p.add_argument("--optimistic", choices=("default", "off", "on"), default="default",
                   help="optimistic_grammar: constrained rows sample first and the grammar checks after (default: on CUDA)")
    p.add_argument("--mask-threads", default=None,
                   help="OMNI_ASYNC_GRAMMAR_THREADS for this run: N (the mask worker's N slice threads), pool:N, or 0")
    p.add_argument("--grammar-backend", choices=("default", "llguidance", "xgrammar"), default="default",
                   help="OMNI_ASYNC_GRAMMAR_BACKEND for this run (default: as the environment says; unset, xgrammar where "
                        "installed, else llguidance: structured/xgrammar_backend.py; the table's 'xgrammar compiles' says which)")
    p.add_argument("--lengths", default=None, help="LO,HI: prompt and output lengths drawn from LO-HI (default 100,1024; "
                        "shorter keeps a CPU run of a real vocabulary's model within minutes)")
    p.add_argument("--schemas", type=int, default=1,
                   help="constrained requests spread over this many variants of the schema, compiled apart (default 1)")
    p.add_argument("--no-jump-forward", action="store_true", help="decode forced tokens one by one (jump_forward=False)")
    p.add_argument("--jump-forward", action="store_true", help="append forced runs without a step each (jump_forward=True; "
                   "constrained rows then mask first: optimistic rows need it off)")
    p.add_argument("--checkpoint-dir", default="/tmp/omni-bench-checkpoints")
    p.add_argument("--smoke", action="store_true", help="8 short requests (16-48 tokens), one repeat unless --repeats, "
                   "4 forwards per decode step unless --decode-steps (CPU)")
    p.add_argument("--malloc", default="default", help="see _common.apply_malloc_mode")
    p.add_argument("--torch-threads", type=int, default=None)
    p.add_argument("--out", default=None, help="default constrained_<device>.json (constrained_smoke.json with --smoke)")
    args = p.parse_args(argv)
    args.arms = tuple(a for a in ARMS if a in args.arms.split(","))
    if not args.arms:
        p.error(f"--arms: choose from {','.join(ARMS)}")
    if args.loops is None:
        args.loops = "overlap" if args.device == "cuda" else ",".join(C.LOOPS)
    if args.smoke:
        args.requests = min(args.requests, 8)
        args.repeats = 1 if args.repeats is None else args.repeats
        if args.decode_steps is None:
            args.decode_steps = 4  # the fused launch and its split, as on CUDA at large batches
    if args.repeats is None:
        args.repeats = 3
    if args.out is None:
        args.out = "constrained_smoke.json" if args.smoke else f"constrained_{args.device}.json"
    return args


def main(argv: list[str] | None = None) -> int:
    return C.run_benchmark(parse_args(argv), main_async, print_table)


if __name__ == "__main__":
    sys.exit(main())
