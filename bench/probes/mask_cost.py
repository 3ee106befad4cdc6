#!/usr/bin/env python
"""Where the mask worker's time goes in the engine, against the library's own time on the same rows.

Why: on the H200 (2026-12-05) the all-constrained arm's mask worker took 64 us a row where the same
library calls alone took 17 us a row (``bench/probes/mask_threads.py``); on the 2-core VM ~150 us
against ~10. This runs the all-constrained arm of ``bench/constrained.py`` (its SCHEMA, temperature
0.6, ``ignore_eos``) through the real engine, stage, batch core, matchers and mask worker over a
null device (``bench/host_overhead.py``'s: the forward is a modelled wait, the loop thread does
everything else as on CUDA, decode launches inline) with a tiny random model that has SmolLM2's
49,152-token vocabulary and tokenizer, so the loop thread is as busy per step as on the H200 and
the masks are as costly. The logits are zeros, so each constrained row samples uniformly among the
tokens its mask admits.

Per masked row (a row-step sampled under a mask): the worker's wall (its tickets), its thread CPU
time (``time.thread_time``), the time inside its loop over the library calls
(``prefetch.compute_slice``, wrapped) and outside it, the rows it computed, and the wait of a ticket
in the queue (submit to the worker taking it); ``--recompute N`` also computes every N-th ticket's
rows' masks a second time at once on the worker (the library on the same states again; not counted
in the worker's figures). Every constrained output is checked by a fresh matcher. ``--code A --code
B`` runs each checkout in its own process, alternating, ``--repeats`` runs each (the figures of
every process saved).

    python bench/probes/mask_cost.py --requests 128 --tokens 64 --repeats 5
    python bench/probes/mask_cost.py --code /tmp/before --code . --labels before,after --repeats 5
    python bench/probes/mask_cost.py --library --requests 128 --tokens 48   # the library alone, first masks vs again
    python bench/probes/mask_cost.py --smoke
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, os.environ.get("MASK_COST_CODE") or str(Path(__file__).resolve().parent.parent.parent))

import omni_async  # noqa: E402  (first: the checkout asked for, before constrained.py puts this one on the path)
from _common import HostLoad, machine_facts, save_json  # noqa: E402
from constrained import SCHEMA, GrammarReplay  # noqa: E402

CHECKPOINT = Path("/tmp/omni-bench-checkpoints/tiny-smol")


def tiny_smol(folder: Path = CHECKPOINT) -> Path:
    """A two-layer random Qwen2 (hidden 64) with SmolLM2's vocabulary and tokenizer (from its GGUF)."""
    if (folder / "config.json").exists() and (folder / "tokenizer.json").exists():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from omni_async.models.gguf import GGUFFile, config_from_gguf, load_gguf_tokenizer, smollm2_path

    torch.manual_seed(0)
    cfg = Qwen2Config(bos_token_id=1, eos_token_id=2, pad_token_id=0, vocab_size=49152, hidden_size=64,
                      intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4096, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    f = GGUFFile(smollm2_path())
    load_gguf_tokenizer(f, config_from_gguf(f)).backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": "<|im_start|>"}))
    return folder


class WorkerClock:
    """The mask worker's library calls timed one by one, its tickets' queue waits, its CPU time."""

    def __init__(self, recompute: int) -> None:
        from omni_async.structured import prefetch

        self.prefetch, self.recompute = prefetch, recompute
        self.inner_slice, self.inner_submit = prefetch.compute_slice, prefetch.MaskWorker.submit
        self.inner_compute = prefetch.MaskWorker._compute
        self.submitted: dict[int, float] = {}
        self.samples: list[tuple[int, float]] | None = None  # (row in the ticket, seconds) of every call, when asked
        self.reset()
        clock = self

        def compute_slice(*args, **kwargs):  # whatever this checkout's signature
            t0 = time.perf_counter()
            try:
                return clock.inner_slice(*args, **kwargs)
            finally:
                clock.in_calls += time.perf_counter() - t0

        def submit(worker, handles):
            ticket = clock.inner_submit(worker, handles)
            if ticket is not None:
                clock.submitted[id(ticket)] = time.perf_counter()
            return ticket

        def compute(worker, todo):
            now, c0 = time.perf_counter(), time.thread_time()
            for ticket in todo:
                t = clock.submitted.pop(id(ticket), None)
                if t is not None:
                    clock.queue_s += now - t
                    clock.tickets += 1
            clock.inner_compute(worker, todo)
            clock.cpu_s += time.thread_time() - c0
            clock.calls += 1
            if clock.recompute and clock.calls % clock.recompute == 0:
                handles = [h for ticket in todo for h in ticket.handles]
                scratch = prefetch.np.empty((len(handles), worker.words), dtype=prefetch.np.int32)
                t0 = time.perf_counter()
                for j, h in enumerate(handles):
                    h.unsafe_compute_mask_ptr(scratch.ctypes.data + j * scratch.strides[0], scratch.strides[0])
                clock.again_s += time.perf_counter() - t0
                clock.again_rows += len(handles)
                worker.seconds -= time.perf_counter() - t0  # not the worker's own work

        prefetch.compute_slice = compute_slice
        prefetch.MaskWorker.submit = submit
        prefetch.MaskWorker._compute = compute

        from omni_async.core import batch_core

        inner_jump = batch_core.jump_rows

        def jump_rows(*args, **kwargs):  # the loop thread's jump-forward pass (reads masks or runs, accepts)
            t0 = time.perf_counter()
            try:
                return inner_jump(*args, **kwargs)
            finally:
                clock.jump_s += time.perf_counter() - t0

        batch_core.jump_rows = jump_rows

    def reset(self) -> None:
        self.in_calls = self.queue_s = self.cpu_s = self.again_s = self.jump_s = 0.0
        self.tickets = self.calls = self.again_rows = 0


async def one_run(engine, work, clock: WorkerClock, replay: GrammarReplay, temperature: float) -> dict:
    from omni_async import SamplingParams

    sps = [SamplingParams(max_new_tokens=n, temperature=temperature, seed=i, ignore_eos=True, json_schema=SCHEMA)
           for i, (_, n) in enumerate(work)]
    await engine.flush_cache()
    graphs = engine.scheduler.runner.graphs
    graphs.free_at = 0.0
    info0 = engine.scheduler.info()
    clock.reset()
    load = HostLoad()
    t0 = time.perf_counter()
    results = await asyncio.gather(*[engine.generate(input_ids=p, sampling=sp) for (p, _), sp in zip(work, sps)])
    wall = time.perf_counter() - t0
    host = load.stop()
    info = engine.scheduler.info()
    d = {k: info[k] - (info0.get(k) or 0) for k in info if isinstance(info[k], (int, float)) and not isinstance(info[k], bool)}
    rows = max(d.get("grammar_mask_rows", 0), 1)  # row-steps sampled under a mask: what every figure is per
    masked = max(d.get("grammar_mask_steps", 0), 1)
    tokens = sum(len(r.output_ids) for r in results)
    valid = sum(replay.accepts(r.output_ids) and len(r.output_ids) == n for r, (_, n) in zip(results, work))
    return {
        "tok_s": tokens / wall, "wall_s": wall, "tokens": tokens, "steps": d.get("steps", 0),
        "step_ms": 1e3 * wall / max(d.get("steps", 1), 1),
        "valid": valid, "requests": len(results),
        "rows": d.get("grammar_mask_rows", 0), "masked_steps": d.get("grammar_mask_steps", 0),
        "rows_per_masked_step": d.get("grammar_mask_rows", 0) / masked,
        "worker_us_per_row": 1e6 * d.get("grammar_mask_worker_s", 0.0) / rows,
        "worker_cpu_us_per_row": 1e6 * clock.cpu_s / rows,
        "in_calls_us_per_row": 1e6 * clock.in_calls / rows,
        "outside_calls_us_per_row": 1e6 * (d.get("grammar_mask_worker_s", 0.0) - clock.in_calls) / rows,
        "worker_rows": d.get("grammar_mask_prefetched_rows", 0),  # rows the worker computed (a mask or a run)
        "forced_from_runs": d.get("grammar_forced_from_runs", 0),
        "queue_us_per_ticket": 1e6 * clock.queue_s / max(clock.tickets, 1),
        "recomputed_us_per_row": 1e6 * clock.again_s / clock.again_rows if clock.again_rows else None,
        "worker_calls": d.get("grammar_mask_worker_calls", 0),
        "fill_ms_per_masked_step": 1e3 * d.get("grammar_mask_s", 0.0) / masked,
        "late_fill_ms": 1e3 * d.get("grammar_late_mask_s", 0.0) / max(d.get("grammar_late_mask_steps", 0), 1),
        "mask_pct_of_step": 100 * (d.get("grammar_mask_s", 0.0) / masked) / (wall / max(d.get("steps", 1), 1)),
        "forced_pct": 100 * d.get("grammar_forced_masks", 0) / max(tokens, 1),
        "skipped": d.get("grammar_forced_skipped", 0), "jumps": d.get("grammar_jumps", 0),
        "jump_pass_us_per_token": 1e6 * clock.jump_s / max(tokens, 1),  # the loop thread's, per generated token
        "inline_rows": d.get("grammar_mask_inline_rows", 0),
        "code": str(Path(omni_async.__file__).parent.parent), "jump_forward": bool(engine.scheduler.config.jump_forward),
        "own_cores": host["own_cores"], "others_cores": host["others_cores"],
    }


def make_engine(args):
    from host_overhead import StepClock, install_null_device  # noqa: F401

    from omni_async import Engine

    path = tiny_smol() if not args.smoke else "tiny"
    eng = Engine.from_pretrained(str(path), device="cpu", loop=args.loop, max_running_requests=args.requests,
                                 kv_capacity_tokens=args.requests * (args.prompt + args.tokens + 64),
                                 decode_steps=args.decode_steps, jump_forward=args.jump, optimistic_grammar=False)
    install_null_device(eng, args.device_us / 1e6, fused=args.decode_steps > 1)
    return eng


def work_for(args, vocab: int) -> list[tuple[list[int], int]]:
    import random

    rng = random.Random(0)
    return [([rng.randrange(3, vocab) for _ in range(args.prompt)], args.tokens) for _ in range(args.requests)]


async def main_async(args) -> dict:
    import torch

    torch.set_num_threads(args.torch_threads)
    clock = WorkerClock(args.recompute)
    engine = make_engine(args)
    runs = []
    async with engine:
        replay = GrammarReplay(engine.tokenizer)
        work = work_for(args, engine.tokenizer.vocab_size)
        await one_run(engine, work, clock, replay, args.temperature)  # warm-up
        for rep in range(args.repeats):
            r = await one_run(engine, work, clock, replay, args.temperature)
            runs.append(r)
            print(f"rep {rep}: {r['tok_s']:.0f} tok/s, step {r['step_ms']:.2f} ms, {r['rows_per_masked_step']:.1f} rows a "
                  f"masked step; worker {r['worker_us_per_row']:.1f} us a row (cpu {r['worker_cpu_us_per_row']:.1f}, "
                  f"in the library loop {r['in_calls_us_per_row']:.1f}, outside it {r['outside_calls_us_per_row']:.1f}; "
                  f"{r['worker_rows']} rows computed, {r['forced_from_runs']} masks from runs; recomputed {r['recomputed_us_per_row'] or 0:.1f}); queue "
                  f"{r['queue_us_per_ticket']:.0f} us a ticket; fill {r['fill_ms_per_masked_step']:.3f} ms "
                  f"({r['mask_pct_of_step']:.1f}% of a step); forced {r['forced_pct']:.0f}%, skipped {r['skipped']}; "
                  f"valid {r['valid']}/{r['requests']}", flush=True)
        replay.close()
    return {"runs": runs}


def library_walk(rows: int, steps: int, seed: int = 0) -> dict:
    """The library alone on the kind of rows the engine masks: ``rows`` matchers of SCHEMA
    walking ``steps`` random admissible tokens; at each new state the first mask, the same
    mask again (what ``mask_threads.py`` times: states it has computed before), and the
    forced-token query on a copy made before either, us a row."""
    import numpy as np

    from grammar_batch import tokenizer

    from omni_async.structured.grammar import GrammarCompiler

    tok, vocab = tokenizer(False, str(tiny_smol()))
    words = (vocab + 31) // 32
    compiler = GrammarCompiler(tok, vocab)
    key = ("json_schema", json.dumps(SCHEMA))
    handles = [compiler.matcher(key).handle for _ in range(rows)]
    rng = np.random.default_rng(seed)
    buf = np.empty(words, dtype=np.int32)
    pc = time.perf_counter
    first, again, ff, forced = [], [], [], 0
    for _ in range(steps):
        for h in handles:
            c = h.deep_copy()
            t0 = pc()
            h.unsafe_compute_mask_ptr(buf.ctypes.data, buf.nbytes)
            t1 = pc()
            h.unsafe_compute_mask_ptr(buf.ctypes.data, buf.nbytes)
            t2 = pc()
            forced += bool(c.compute_ff_tokens())
            ff.append(pc() - t2)
            first.append(t1 - t0)
            again.append(t2 - t1)
            allowed = np.flatnonzero(np.unpackbits(buf.view(np.uint8), bitorder="little")[:vocab])
            h.consume_token(int(rng.choice(allowed)))
    compiler.close()
    stat = lambda xs: {"mean_us": 1e6 * statistics.mean(xs), "median_us": 1e6 * statistics.median(xs),
                       "p99_us": 1e6 * sorted(xs)[int(0.99 * (len(xs) - 1))]}
    return {"first_mask": stat(first), "same_mask_again": stat(again), "forced_query_on_a_copy": stat(ff),
            "forced_pct": 100 * forced / len(first), "positions": len(first)}


def summarize(runs: list[dict]) -> dict:
    keys = [k for k, v in runs[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return {k: {"median": statistics.median(r[k] for r in runs), "min": min(r[k] for r in runs),
                "max": max(r[k] for r in runs)} for k in keys}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--loop", default="overlap")
    p.add_argument("--decode-steps", type=int, default=1)
    p.add_argument("--device-us", type=float, default=2000.0, help="the modelled device's time per forward")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--jump", action="store_true", help="jump_forward=True")
    p.add_argument("--recompute", type=int, default=0, help="every N-th ticket's rows computed again at once (0: never)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--switch-ms", type=float, default=None, help="sys.setswitchinterval for the run (default Python's 5 ms)")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--code", action="append", help="a checkout to measure, in a process of its own (repeat: alternated); "
                   "PATH::--jump adds options for that one (e.g. the same checkout with and without jump-forward)")
    p.add_argument("--labels", default="")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--library", action="store_true", help="the library alone on a walk of --requests rows, --tokens steps")
    args = p.parse_args()
    if args.smoke:
        args.requests, args.tokens, args.prompt, args.repeats = 8, 16, 16, 1
    if args.code:
        return compare(args)
    if args.library:
        res = library_walk(args.requests, args.tokens)
        print(json.dumps(res, indent=1))
        print(f"saved {save_json(args.out or 'mask_cost_library.json', {'walk': res, 'args': vars(args), 'machine': machine_facts(), 'load': os.getloadavg()})}")
        return 0
    if args.switch_ms:
        sys.setswitchinterval(args.switch_ms / 1e3)
    t0 = time.perf_counter()
    res = asyncio.run(main_async(args))
    res.update(summary=summarize(res["runs"]), args=vars(args), machine=machine_facts(), load=os.getloadavg(),
               took_s=time.perf_counter() - t0)
    if args.child:
        print(json.dumps(res["runs"][0]))
        return 0
    out = args.out or ("mask_cost_smoke.json" if args.smoke else "mask_cost.json")
    print(json.dumps({k: v["median"] for k, v in res["summary"].items()}))
    print(f"saved {save_json(out, res)}")
    return 0


def compare(args) -> int:
    """Each checkout in its own process, one measured run (after a warm-up run) a process,
    the checkouts alternated ``--repeats`` times, so load drifts hit them alike."""
    labels = args.labels.split(",") if args.labels else [Path(c.split("::")[0]).resolve().name for c in args.code]
    skip = {"--code", "--labels", "--repeats", "--out"}
    argv, it = [], iter(sys.argv[1:])
    for a in it:
        if a in skip:
            next(it, None)
        elif not a.startswith("--code=") and not a.startswith("--labels="):
            argv.append(a)
    runs: dict[str, list[dict]] = {label: [] for label in labels}
    for rep in range(args.repeats):
        order = list(zip(args.code, labels)) if rep % 2 == 0 else list(reversed(list(zip(args.code, labels))))
        for code, label in order:
            path, _, extra = code.partition("::")
            env = dict(os.environ, MASK_COST_CODE=str(Path(path).resolve()))
            out = subprocess.run([sys.executable, __file__, *argv, *extra.split(), "--repeats", "1", "--child"], env=env,
                                 capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            runs[label].append(r)
            print(f"{label:8s} rep {rep}: {r['tok_s']:.0f} tok/s, worker {r['worker_us_per_row']:.1f} us a masked row "
                  f"(cpu {r['worker_cpu_us_per_row']:.1f}), fill {r['fill_ms_per_masked_step']:.3f} ms = "
                  f"{r['mask_pct_of_step']:.1f}% of a step, jump pass {r['jump_pass_us_per_token']:.1f} us a token, "
                  f"{r['steps']} steps, valid {r['valid']}/{r['requests']}", flush=True)
    summary = {label: summarize(rs) for label, rs in runs.items()}
    base = labels[0]
    for label in labels[1:]:
        ratios = [b["tok_s"] / a["tok_s"] for a, b in zip(runs[base], runs[label])]
        wr = [b["worker_us_per_row"] / a["worker_us_per_row"] for a, b in zip(runs[base], runs[label])]
        summary[label]["paired_tok_s_ratio"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
        summary[label]["paired_worker_ratio"] = {"median": statistics.median(wr), "min": min(wr), "max": max(wr)}
    for label, sm in summary.items():
        print(label, {k: f"{v['median']:.3g} [{v['min']:.3g}-{v['max']:.3g}]" for k, v in sm.items()
                      if k in ("tok_s", "worker_us_per_row", "worker_cpu_us_per_row", "in_calls_us_per_row",
                               "fill_ms_per_masked_step", "mask_pct_of_step", "step_ms", "paired_tok_s_ratio",
                               "paired_worker_ratio", "forced_pct", "queue_us_per_ticket", "valid", "jump_pass_us_per_token",
                               "steps")})
    payload = {"labels": labels, "codes": args.code, "runs": runs, "summary": summary, "args": vars(args),
               "machine": machine_facts(), "load": os.getloadavg()}
    print(f"saved {save_json(args.out or 'mask_cost_ab.json', payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
