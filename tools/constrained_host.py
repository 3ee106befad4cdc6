"""Where the host's time of a one-forward decode step goes with every row under a JSON
schema, the device taken out (issue 61).

Why: on an H100 the all-constrained arm of ``bench/constrained.py`` took ~5.1 ms a decode
step (xgrammar, 256 rows; 9.3 llguidance) where the device needs ~1.6 ms for its one forward:
the host, ~20 us a row. This runs that arm's requests (the bench's SCHEMA, temperature 0.6,
``ignore_eos``) through the real engine, stage, batch core, matchers, mask worker and runner
over ``tools/host_overhead.py``'s null device (decode launches inline on the loop thread,
as on CUDA; one forward a step under late masks, as the H100's all-constrained steps ran),
with ``small-smol`` (SmolLM2's 49,152-token vocabulary: masks as costly as there). The null
device's "sampler" picks, per row, an admissible token of the step's bitmask from a hash
of its fake token (the device's work: timed apart and left out of the host's figures).

Per run: host ms a decode step and us a row-step (loop thread CPU time, which is the wall
here: the null device costs nothing), the same for the all-free arm (one forward a step
too), and ``--profile``'s cProfile of the loop thread grouped by part (mask fill, accept,
late-mask bookkeeping, scheduling, runner inputs, sampling inputs, collect, emission),
us a row-step. Every constrained output is replayed through a fresh matcher.
``--code A --code B`` runs each checkout in its own process, interleaved per repeat.

    python tools/constrained_host.py --requests 256 --tokens 48 --profile
    python tools/constrained_host.py --grammar-backend xgrammar --profile
    python tools/constrained_host.py --code /tmp/before --code . --labels before,after --repeats 3
    python tools/constrained_host.py --grammar-backend xgrammar --inline-masks   # no mask worker
    python tools/constrained_host.py --gil     # does a library's mask call hold the GIL?
    python tools/constrained_host.py --accept  # a step's accepts alone: per-row calls against batch calls
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, os.environ.get("CONSTRAINED_HOST_CODE") or str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "bench"))
sys.path.insert(0, str(HERE))

import omni_async  # noqa: E402  (the checkout asked for, first)

# cProfile's functions grouped by the part of the step they belong to: (group, file part, function or "").
GROUPS = (
    ("device stand-in (excluded)", "constrained_host.py", ""),
    ("device stand-in (excluded)", "host_overhead.py", ""),
    ("mask fill", "batch_mask.py", ""),
    ("mask fill", "xgrammar_backend.py", "fill_masks"),
    ("accept (matcher)", "grammar.py", ""),
    ("accept (matcher)", "xgrammar_backend.py", ""),
    ("accept (matcher)", "LLMatcher", ""),
    ("accept (matcher)", "GrammarMatcher", ""),
    ("mask worker handoff", "prefetch.py", ""),
    ("late-mask / multi-step rules", "multi_step.py", ""),
    ("late-mask / multi-step rules", "request.py", ""),
    ("batch core: schedule + process", "batch_core.py", ""),
    ("batch core: schedule + process", "step_results.py", ""),
    ("batch core: schedule + process", "core_state.py", ""),
    ("batch core: schedule + process", "policy.py", ""),
    ("batch core: schedule + process", "plan.py", ""),
    ("batch core: schedule + process", "batch.py", ""),
    ("runner inputs", "input_batch.py", ""),
    ("runner inputs", "forward_batch.py", ""),
    ("runner inputs", "native.py", ""),
    ("runner inputs", "cuda_graphs.py", ""),
    ("sampling inputs", "sampling.py", ""),
    ("sampling inputs", "logit_controls.py", ""),
    ("runner launch/collect", "base.py", ""),
    ("runner launch/collect", "host_copy.py", ""),
    ("stage / stepper / emission", "omni_async/stage", ""),
    ("stage / stepper / emission", "omni_async/loops", ""),
    ("stage / stepper / emission", "omni_async/serving", ""),
    ("stage / stepper / emission", "omni_async/engine.py", ""),
    ("stage / stepper / emission", "omni_async/scheduler.py", ""),
    ("asyncio / event loop", "asyncio", ""),
    ("torch / numpy calls", "torch", ""),
    ("torch / numpy calls", "numpy", ""),
)


def group_of(file: str, func: str) -> str:
    for group, part, name in GROUPS:
        if part in file and (not name or name == func):
            return group
    if file == "~":  # builtins: by their name
        for group, part, name in GROUPS:
            if part in func and not name:
                return group
        return "builtins (other)"
    return "other"


# Seconds in the null sampler (the device's work, run inline on the loop thread): subtracted
# from a run's wall for "host_us_per_token" (us_per_row_step keeps it, as earlier sections read it).
STAND_IN = [0.0]


def null_sampler(runner_cls):
    """The null device's sampling: per row, an admissible token of the step's bitmask,
    picked by a hash of the fake token among the mask's nonzero words, its lowest bit
    there (numpy over the whole batch: the device's work). Rows without a mask keep the
    fake token."""
    import numpy as np
    import torch

    from omni_async.runners.sampling import SampleResult

    class Sampled(runner_cls):  # type: ignore[misc, valid-type]
        def sample_logits(self, result, sb, top_k_logprobs):
            t0 = time.perf_counter()
            try:
                return self._pick(result, sb)
            finally:
                STAND_IN[0] += time.perf_counter() - t0

        def _pick(self, result, sb):
            tokens, ok = result.graph_greedy
            if sb.allowed is None:
                return SampleResult(tokens=tokens, logprobs=None, ok=ok)
            bits = sb.allowed.numpy().view(np.uint32)
            nz = bits != 0
            counts = nz.sum(1)
            pick = tokens.numpy() % np.maximum(counts, 1)
            word = np.argmax(np.cumsum(nz, 1) > pick[:, None], 1)
            w = bits[np.arange(len(word)), word].astype(np.int64)
            low = np.log2((w & -w).astype(np.float64)).astype(np.int64)
            out = np.where(counts > 0, word * 32 + low, tokens.numpy())
            return SampleResult(tokens=torch.from_numpy(out), logprobs=None, ok=ok)

    return Sampled


class Phases:
    """Loop-thread seconds in the step's parts, by wrapping their functions (a call a step
    each, but the matcher's ``accept``, a call a row: its wrapper's ~0.2 us a row counted in)."""

    def __init__(self, engine) -> None:
        from omni_async.core import batch_core, step_results
        from omni_async.structured import batch_mask, grammar

        self.s: dict[str, float] = {}
        core = engine.scheduler.core if hasattr(engine.scheduler, "core") else None
        runner = engine.scheduler.runner
        targets = [("schedule", type(core) if core is not None else None, "get_next_batch"),
                   ("process (batch core, accept in it)", type(core) if core is not None else None, "process_result"),
                   ("  accept (per row)", grammar.GrammarMatcher, "accept"),
                   ("  queue next masks (prefetch_all)", grammar, "prefetch_all"),
                   ("launch (inputs, forward stand-in)", type(runner), "launch"),
                   ("sample_pending (fill, sample, publish, copy)", type(runner), "sample_pending"),
                   ("  mask fill", batch_mask.GrammarMasks, "fill"),
                   ("  sampling inputs", type(runner), "sampling_batch"),
                   ("  device sampler stand-in", type(runner), "sample_logits"),
                   ("collect", type(runner), "collect")]
        for name, owner, attr in targets:
            if owner is None or not hasattr(owner, attr):
                continue
            self._wrap(name, owner, attr)
        if hasattr(batch_core, "prefetch_all"):
            self._wrap("  queue next masks (prefetch_all)", batch_core, "prefetch_all")
        _ = step_results

    def _wrap(self, name: str, owner, attr: str) -> None:
        inner = getattr(owner, attr)
        s = self.s
        s.setdefault(name, 0.0)
        pc = time.perf_counter

        def wrapped(*a, **k):
            t0 = pc()
            try:
                return inner(*a, **k)
            finally:
                s[name] += pc() - t0

        setattr(owner, attr, wrapped)

    def take(self) -> dict[str, float]:
        out = dict(self.s)
        for k in self.s:
            self.s[k] = 0.0
        return out


def make_engine(args):
    from constrained import qwen05_smol
    from host_overhead import install_null_device

    from omni_async import Engine

    if args.grammar_backend != "default":
        os.environ["OMNI_ASYNC_GRAMMAR_BACKEND"] = args.grammar_backend
    path = qwen05_smol(Path(args.checkpoint_dir) / "small-smol", small=True)
    eng = Engine.from_pretrained(str(path), device="cpu", loop=args.loop, max_running_requests=args.requests,
                                 kv_capacity_tokens=args.requests * (args.prompt + args.tokens + 64),
                                 decode_steps=args.decode_steps, jump_forward=False, optimistic_grammar=False)
    install_null_device(eng, fused=args.decode_steps > 1)  # (free rows' k forwards: the fused launch's host path)
    if args.inline_masks:  # no mask worker: the fill computes every row on the loop thread
        from omni_async.structured import prefetch

        prefetch.MaskWorker.submit = lambda self, handles: None
    runner = eng.scheduler.runner
    runner.__class__ = null_sampler(type(runner))
    return eng


async def one_run(engine, work, arm: str, replay, profile: bool, phases: "Phases | None" = None) -> dict:
    from constrained import SCHEMA

    from omni_async import SamplingParams

    sps = [SamplingParams(max_new_tokens=n, temperature=0.6, seed=i, ignore_eos=True,
                          json_schema=SCHEMA if arm == "all" else None) for i, (_, n) in enumerate(work)]
    await engine.flush_cache()
    info0 = engine.scheduler.info()
    if phases is not None:
        phases.take()
    prof = cProfile.Profile() if profile else None
    s0 = STAND_IN[0]
    t0, c0 = time.perf_counter(), time.thread_time()
    if prof:
        prof.enable()
    results = await asyncio.gather(*[engine.generate(input_ids=p, sampling=sp) for (p, _), sp in zip(work, sps)])
    if prof:
        prof.disable()
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    info = engine.scheduler.info()
    d = {k: info[k] - (info0.get(k) or 0) for k in info if isinstance(info[k], (int, float)) and not isinstance(info[k], bool)}
    tokens = sum(len(r.output_ids) for r in results)
    steps = max(d.get("steps", 1), 1)
    out = {"arm": arm, "tokens": tokens, "steps": d.get("steps", 0), "wall_s": wall, "loop_cpu_s": cpu,
           "tok_s": tokens / wall, "ms_per_step": 1e3 * wall / steps, "cpu_ms_per_step": 1e3 * cpu / steps,
           "us_per_row_step": 1e6 * wall / max(tokens, 1),
           "host_us_per_token": 1e6 * (wall - (STAND_IN[0] - s0)) / max(tokens, 1),
           "stand_in_us_per_token": 1e6 * (STAND_IN[0] - s0) / max(tokens, 1),
           "mask_rows": d.get("grammar_mask_rows", 0), "late_steps": d.get("grammar_late_mask_steps", 0),
           "fill_us_per_row": 1e6 * d.get("grammar_mask_s", 0.0) / max(d.get("grammar_mask_rows", 0), 1),
           "worker_us_per_row": 1e6 * d.get("grammar_mask_worker_s", 0.0) / max(d.get("grammar_mask_rows", 0), 1),
           "inline_rows": d.get("grammar_mask_inline_rows", 0)}
    if arm == "all":
        out["valid"] = sum(replay.accepts(r.output_ids) and len(r.output_ids) == n for r, (_, n) in zip(results, work))
        out["requests"] = len(results)
    out["digest"] = hash(tuple(tuple(r.output_ids) for r in results)) & 0xFFFFFFFF
    decode = max(d.get("decode_steps", 0) or steps, 1)
    out["decode_steps"] = d.get("decode_steps", 0)
    if prof:
        out["profile"] = grouped(prof, tokens, steps, wall)
    if phases is not None:
        took = phases.take()
        out["phases_ms_per_step"] = {k: 1e3 * v / steps for k, v in took.items()}
        out["phases_us_per_row_step"] = {k: 1e6 * v / max(tokens, 1) for k, v in took.items()}
    _ = decode
    return out


def grouped(prof: cProfile.Profile, row_steps: int, steps: int, wall: float) -> dict:
    """Own time (tottime) by group, us a row-step; and the top functions."""
    st = pstats.Stats(prof)
    groups: dict[str, float] = {}
    top = []
    for (file, line, func), (cc, nc, tt, ct, callers) in st.stats.items():  # type: ignore[attr-defined]
        g = group_of(file, func)
        groups[g] = groups.get(g, 0.0) + tt
        top.append((tt, nc, f"{Path(file).name}:{line}:{func}", g))
    top.sort(reverse=True)
    total = sum(groups.values())
    return {"total_profiled_s": total, "wall_s": wall,
            "us_per_row_step": {g: 1e6 * s / max(row_steps, 1) for g, s in sorted(groups.items(), key=lambda x: -x[1])},
            "ms_per_step": {g: 1e3 * s / steps for g, s in sorted(groups.items(), key=lambda x: -x[1])},
            "top": [{"tottime_s": tt, "calls": nc, "calls_per_row_step": nc / max(row_steps, 1), "func": f, "group": g}
                    for tt, nc, f, g in top[:150]]}


async def main_async(args) -> dict:
    import random

    import torch

    from constrained import SCHEMA, GrammarReplay

    torch.set_num_threads(1)
    engine = make_engine(args)
    phases = Phases(engine) if args.phases else None
    runs = []
    async with engine:
        replay = GrammarReplay(engine.tokenizer, engine.scheduler.info().get("grammar_backend"))
        rng = random.Random(0)
        vocab = engine.tokenizer.vocab_size
        work = [([rng.randrange(3, vocab) for _ in range(args.prompt)], args.tokens) for _ in range(args.requests)]
        arms = args.arms.split(",")
        for arm in arms:
            await one_run(engine, work, arm, replay, False)  # warm-up
        for rep in range(args.repeats):
            for arm in arms:
                r = dict(await one_run(engine, work, arm, replay, args.profile, phases), repeat=rep)
                runs.append(r)
                print(f"rep {rep} {arm}: {r['ms_per_step']:.2f} ms a step ({r['us_per_row_step']:.1f} us a row-step, "
                      f"{r['host_us_per_token']:.1f} without the stand-in sampler), "
                      f"{r['steps']} steps, fill {r['fill_us_per_row']:.1f} us a masked row, worker "
                      f"{r['worker_us_per_row']:.1f}" + (f", valid {r['valid']}/{r['requests']}" if arm == "all" else ""),
                      flush=True)
                if phases is not None and not args.child:
                    for g, us in r["phases_us_per_row_step"].items():
                        print(f"    {g:46s} {us:7.2f} us a row-step  {r['phases_ms_per_step'][g]:6.3f} ms a step")
                if args.profile and not args.child:
                    for g, us in r["profile"]["us_per_row_step"].items():
                        print(f"    {g:34s} {us:7.2f} us a row-step")
        replay.close()
        _ = SCHEMA
    return {"runs": runs, "code": str(Path(omni_async.__file__).parent.parent),
            "backend": engine.scheduler.info().get("grammar_backend")}


def gil_probe(args) -> dict:
    """Whether a grammar library's one mask call for many rows lets other Python threads run:
    a counting thread's rate during one call (xgrammar's batch fill; llguidance's executor on
    one thread) of ~0.1 s, against its rate during a 0.1 s ``time.sleep`` (which releases the
    GIL). Calls of a few ms mislead: a thread waiting for the GIL may not be woken within
    one (a 3 ms call once read 0.00 here, then 0.89 on the next run)."""
    import threading

    import numpy as np
    from constrained import SCHEMA
    from grammar_batch import tokenizer

    from omni_async.structured import xgrammar_backend
    from omni_async.structured.grammar import GrammarCompiler

    tok, vocab = tokenizer(False, str(Path(args.checkpoint_dir) / "small-smol"))
    out = {}
    for backend, copies in (("xgrammar", 200), ("llguidance", 40)):
        comp = GrammarCompiler(tok, vocab, backend=backend)
        if backend == "xgrammar":  # (llguidance's executor refuses a matcher twice in one call)
            handles = [comp.matcher(("json_schema", json.dumps(SCHEMA))).handle for _ in range(256)] * copies
        else:
            handles = [comp.matcher(("json_schema", json.dumps(SCHEMA))).handle for _ in range(256 * copies)]
        masks = np.empty((len(handles), (vocab + 31) // 32), dtype=np.int32)
        if backend == "xgrammar":
            call = lambda: xgrammar_backend.fill_masks(handles, masks)  # noqa: E731
        else:
            import llguidance

            ex = llguidance.LLExecutor(num_threads=1)
            pairs = [(h, j) for j, h in enumerate(handles)]
            call = lambda: ex.unsafe_compute_mask_ptr(pairs, masks.ctypes.data, masks.shape[1] * 4, len(pairs))  # noqa: E731
        call()
        count, stop = [0], threading.Event()

        def tick() -> None:
            while not stop.is_set():
                count[0] += 1

        th = threading.Thread(target=tick)
        th.start()
        time.sleep(0.2)
        ratios, calls_ms = [], []
        for _ in range(3):
            c0, t0 = count[0], time.perf_counter()
            time.sleep(0.1)
            during_sleep = (count[0] - c0) / (time.perf_counter() - t0)
            c0, t0 = count[0], time.perf_counter()
            call()
            took = time.perf_counter() - t0
            ratios.append((count[0] - c0) / took / during_sleep)
            calls_ms.append(1e3 * took)
        stop.set()
        th.join()
        comp.close()
        out[backend] = {"rows": len(handles), "call_ms": calls_ms, "other_thread_rate_vs_sleep": ratios}
        print(f"{backend}: one mask call of {len(handles)} rows {statistics.median(calls_ms):.1f} ms; a Python thread "
              f"beside it ran at {[round(r, 2) for r in ratios]} of its rate beside a sleep (0: the call holds the GIL)",
              flush=True)
    return out


def accept_probe(args) -> dict:
    """A step's accepts alone, us a row: 256 matchers of SCHEMA (SmolLM2's vocabulary) each
    taking its token of a random admissible walk, 40 steps, the ways a batch could take them:
    the handle calls the engine makes a row (``consume_token``, ``is_error``, ``is_stopped``),
    ``consume_token`` alone, and each library's batch call (xgrammar's
    ``BatchGrammarMatcher.batch_accept_token`` with the ``is_completed`` the engine's stop rule
    needs, and its raw ``accept_token`` loop; llguidance's ``LLExecutor.consume_token_par``
    on one thread, with ``is_stopped``). Fresh copies of the matchers for each way."""
    import numpy as np
    from constrained import SCHEMA
    from grammar_batch import tokenizer

    from omni_async.structured.grammar import GrammarCompiler

    tok, vocab = tokenizer(False, str(Path(args.checkpoint_dir) / "small-smol"))
    words, steps, pc = (vocab + 31) // 32, 40, time.perf_counter
    out: dict[str, dict] = {}
    for backend in ("xgrammar", "llguidance"):
        comp = GrammarCompiler(tok, vocab, backend=backend)
        handles = [comp.matcher(("json_schema", json.dumps(SCHEMA))).handle for _ in range(args.requests)]
        rng, buf, walks = np.random.default_rng(0), np.empty(words, dtype=np.int32), []
        for h in handles:
            c, walk = h.deep_copy(), []
            for _ in range(steps):
                c.unsafe_compute_mask_ptr(buf.ctypes.data, buf.nbytes)
                walk.append(int(rng.choice(np.flatnonzero(np.unpackbits(buf.view(np.uint8), bitorder="little")[:vocab]))))
                c.consume_token(walk[-1])
            walks.append(walk)
        ways = {"engine's handle calls (consume_token, is_error, is_stopped)":
                lambda hs, toks: [(h.consume_token(t), h.is_error(), h.is_stopped()) for h, t in zip(hs, toks)],
                "consume_token alone": lambda hs, toks: [h.consume_token(t) for h, t in zip(hs, toks)]}
        if backend == "xgrammar":
            import xgrammar

            batch = xgrammar.BatchGrammarMatcher.batch_accept_token
            ways["batch_accept_token + is_completed"] = lambda hs, toks: (
                batch([h._m for h in hs], toks), [h._m.is_completed() for h in hs])
            ways["raw accept_token loop (no wrapper)"] = lambda hs, toks: [h._m.accept_token(t) for h, t in zip(hs, toks)]
        else:
            import llguidance

            ex = llguidance.LLExecutor(num_threads=1)
            ways["consume_token_par (1 thread) + is_stopped"] = lambda hs, toks: (
                ex.consume_token_par(list(zip(hs, toks))), [h.is_stopped() for h in hs])
        res: dict[str, list[float]] = {}
        for _ in range(3):
            for name, way in ways.items():
                hs, took = [h.deep_copy() for h in handles], 0.0
                for j in range(steps):
                    toks = [w[j] for w in walks]
                    t0 = pc()
                    way(hs, toks)
                    took += pc() - t0
                res.setdefault(name, []).append(1e6 * took / (steps * len(handles)))
        comp.close()
        out[backend] = {k: {"median_us_per_row": statistics.median(v), "runs": v} for k, v in res.items()}
        for k, v in res.items():
            print(f"{backend:10s} {k:62s} {statistics.median(v):6.3f} us a row {[round(x, 3) for x in v]}", flush=True)
    return out


def compare(args) -> dict:
    """Each checkout in its own process (one measured repeat after a warm-up), alternated."""
    labels = args.labels.split(",") if args.labels else [Path(c).resolve().name for c in args.code]
    argv = [a for a in sys.argv[1:]]
    skip = {"--code", "--labels", "--repeats", "--out"}
    clean, it = [], iter(argv)
    for a in it:
        if a in skip:
            next(it, None)
        else:
            clean.append(a)
    runs: dict[str, list[dict]] = {label: [] for label in labels}
    for rep in range(args.repeats):
        pairs = list(zip(args.code, labels))
        for code, label in (pairs if rep % 2 == 0 else pairs[::-1]):
            env = dict(os.environ, CONSTRAINED_HOST_CODE=str(Path(code).resolve()))
            out = subprocess.run([sys.executable, __file__, *clean, "--repeats", "1", "--child"], env=env,
                                 capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(out.stderr[-4000:])
            res = json.loads(out.stdout.strip().splitlines()[-1])
            for r in res["runs"]:
                r["repeat"] = rep
                runs[label].append(r)
                print(f"{label:8s} rep {rep} {r['arm']}: {r['ms_per_step']:.2f} ms a step, {r['us_per_row_step']:.2f} us "
                      f"a row-step ({r['host_us_per_token']:.2f} without the stand-in sampler), {r['steps']} steps, "
                      f"digest {r['digest']}"
                      + (f", valid {r['valid']}/{r['requests']}" if r["arm"] == "all" else ""), flush=True)
    summary: dict[str, dict] = {}
    for label in labels:
        for arm in args.arms.split(","):
            xs = [r["ms_per_step"] for r in runs[label] if r["arm"] == arm]
            us = [r["us_per_row_step"] for r in runs[label] if r["arm"] == arm]
            host = [r.get("host_us_per_token", float("nan")) for r in runs[label] if r["arm"] == arm]
            summary[f"{label} {arm}"] = {"ms_per_step_median": statistics.median(xs), "min": min(xs), "max": max(xs),
                                         "us_per_row_step_median": statistics.median(us), "us_min": min(us), "us_max": max(us),
                                         "host_us_median": statistics.median(host), "host_min": min(host),
                                         "host_max": max(host)}
    for label in labels[1:]:  # paired by repeat, against the first label
        for arm in args.arms.split(","):
            a = [r["ms_per_step"] for r in runs[labels[0]] if r["arm"] == arm]
            b = [r["ms_per_step"] for r in runs[label] if r["arm"] == arm]
            ratios = [y / x for x, y in zip(a, b)]
            ua = [r["us_per_row_step"] for r in runs[labels[0]] if r["arm"] == arm]
            ub = [r["us_per_row_step"] for r in runs[label] if r["arm"] == arm]
            per_token = [y / x for x, y in zip(ua, ub)]
            ha = [r.get("host_us_per_token", float("nan")) for r in runs[labels[0]] if r["arm"] == arm]
            hb = [r.get("host_us_per_token", float("nan")) for r in runs[label] if r["arm"] == arm]
            host_ratio = [y / x for x, y in zip(ha, hb)]
            summary[f"{label}/{labels[0]} {arm}"] = {"paired_ratio_median": statistics.median(ratios), "min": min(ratios),
                                                      "max": max(ratios), "per_token_ratio_median": statistics.median(per_token),
                                                      "per_token_min": min(per_token), "per_token_max": max(per_token),
                                                      "host_ratio_median": statistics.median(host_ratio),
                                                      "host_ratio_min": min(host_ratio), "host_ratio_max": max(host_ratio)}
            same = {r["digest"] for r in runs[label] if r["arm"] == arm} == {r["digest"] for r in runs[labels[0]] if r["arm"] == arm}
            summary[f"{label}/{labels[0]} {arm}"]["same_tokens"] = same
    for k, v in summary.items():
        print(k, {kk: (round(vv, 3) if isinstance(vv, float) else vv) for kk, vv in v.items()})
    return {"labels": labels, "codes": args.code, "runs": runs, "summary": summary}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--loop", default="overlap")
    p.add_argument("--arms", default="all,free")
    p.add_argument("--grammar-backend", default="default", choices=("default", "llguidance", "xgrammar"))
    p.add_argument("--decode-steps", type=int, default=1,
                   help="forwards a decode step (CUDA's plan: 8); constrained rows take several under masks between forwards")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--accept", action="store_true", help="a step's accepts alone, the engine's calls against batch calls")
    p.add_argument("--gil", action="store_true", help="whether each library's mask call lets another Python thread run")
    p.add_argument("--inline-masks", action="store_true", help="no mask worker: every mask computed by the step's fill")
    p.add_argument("--phases", action="store_true", help="time the step's parts (wrapped functions)")
    p.add_argument("--checkpoint-dir", default="/tmp/omni-bench-checkpoints")
    p.add_argument("--code", action="append")
    p.add_argument("--labels", default="")
    p.add_argument("--out", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    from _common import machine_facts, save_json

    t0 = time.perf_counter()
    res = accept_probe(args) if args.accept else gil_probe(args) if args.gil else compare(args) if args.code else asyncio.run(main_async(args))
    if args.child:
        print(json.dumps(res))
        return 0
    res.update(args=vars(args), machine=machine_facts(), load=os.getloadavg(), took_s=time.perf_counter() - t0)
    print(f"saved {save_json(args.out or 'constrained_host.json', res)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
