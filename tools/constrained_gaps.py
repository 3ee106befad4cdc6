"""Where the device waits in a constrained run, and what the host was doing then (issue 61).

Why: on the H100 the all-constrained arm of ``bench/constrained.py`` took 23-28 ms a decode step
for ~7 forwards against the free arm's 14 ms for 8, and the host spent 1.5-1.7 ms a forward
between forwards (``between_ms_per_forward``, which counts its wait for the tokens too). Whether
the device runs the next forward while the host computes masks (the design of
``structured/between.py``) or sits idle for them decides what to cut: the host's work or the
order of the launches. This answers it from one profiled run per arm.

Per arm (the bench's engine, workload and requests; every arm run once untimed first): one plain
run (tok/s), then one under ``torch.profiler`` (CPU and CUDA activity) with ``tools/gpu_gaps.py``'s
ranges on the engine's step functions and these too: the runner's forward and its sampling
(``fwd.launch``, ``fwd.sample``), a step's masks between forwards (``between.mask``: the wait for
the tokens, the matchers' accepts, the fill) and the tokens' copy out (``between.send``). The
analysis is ``tools/gap_analysis.py``'s: device busy over the run, each idle gap attributed to the
loop thread's innermost range where it began and ended, and the blocking CUDA call then.

    python tools/constrained_gaps.py --device cuda --arms free,all --out $OUT/constrained_gaps.json
    python tools/constrained_gaps.py --smoke          # CPU, tiny model: the probe end to end
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT))

import constrained as cb  # noqa: E402  (bench/constrained.py)
import gpu_gaps as gg  # noqa: E402
from _common import save_json  # noqa: E402
from gap_analysis import analyse, print_loop  # noqa: E402

from omni_async import Engine  # noqa: E402
from omni_async.structured.between import StepMasks  # noqa: E402

RUNNER_RANGES = {("scheduler.stepper.runner", "_forward"): "fwd.launch",
                 ("scheduler.stepper.runner", "_after_forward"): "fwd.sample"}
CLASS_RANGES = ((StepMasks, "next_mask", "between.mask"), (StepMasks, "send", "between.send"))


def install_class_ranges(rl: gg.RangeLog) -> list[tuple[Any, str, Any]]:
    undo = []
    for cls, attr, name in CLASS_RANGES:
        before = cls.__dict__[attr]
        undo.append((cls, attr, before))
        setattr(cls, attr, rl._sync(before, name))
    return undo


def plain_figures(run: dict[str, Any]) -> dict[str, Any]:
    keep = ("total_tok_s", "free_tok_s", "wall_s", "step_ms", "between_ms_per_forward", "masked_tokens_per_step", "valid",
            "constrained")
    return {k: run.get(k) for k in keep}


async def profile_arm(args: argparse.Namespace, engine: Engine, work: Any, arm: str, replay: Any) -> dict[str, Any]:
    cuda = args.device == "cuda"
    plain = await cb.run_arm(engine, work, arm, replay)
    rl = gg.RangeLog()
    rl.install(engine, RUNNER_RANGES)
    undo = install_class_ranges(rl)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    prof = torch.profiler.profile(activities=acts, record_shapes=False, with_stack=False, profile_memory=False)
    prof.__enter__()
    prof.profiler._parse_kineto_results = lambda *a, **k: []  # (see gpu_gaps.profile_mode)
    try:
        profiled = await cb.run_arm(engine, work, arm, replay)
    finally:
        rl.uninstall()
        for cls, attr, before in undo:
            setattr(cls, attr, before)
        t0 = time.perf_counter()
        prof.__exit__(None, None, None)
        stop_s = time.perf_counter() - t0
    ops, meta = gg.kineto_view(prof, rl, cuda)
    if args.trace_dir:
        Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(Path(args.trace_dir) / f"constrained_{arm}.json"))
    res = analyse(ops, rl.loop, rl.worker, rl.steps, gg.run_window(rl, ops), min_gap_ns=int(args.min_gap_us * 1000),
                  syncs=rl.syncs)
    host: dict[str, list[int]] = {}  # the ranges' host time, loop thread and worker apart (CPU: launches on the worker)
    for thread, ranges in (("", rl.loop), ("worker.", rl.worker)):
        for s, e, name in ranges:
            c = host.setdefault(thread + name, [0, 0])
            c[0] += 1
            c[1] += e - s
    meta.update(profiler_stop_s=stop_s, loop_ranges=len(rl.loop))
    return {"plain": plain_figures(plain), "profiled": plain_figures(profiled), "profile": meta, "gaps": res,
            "host_ranges": {k: {"count": c, "ms": ns / 1e6} for k, (c, ns) in sorted(host.items(), key=lambda kv: -kv[1][1])}}


def print_arm(arm: str, r: dict[str, Any]) -> None:
    p, q = r["plain"], r["profiled"]
    view = {**r, "plain": {"tok_s": p["total_tok_s"], "gpu_busy_mean": None},
            "profiled": {"tok_s": q["total_tok_s"], "gpu_busy_mean": None}, "profile": {**r["profile"], "extract_s": 0.0,
                                                                                        "analyse_s": 0.0}}
    print_loop("constrained", arm, view, top=10)
    print(f"  plain: step {p['step_ms']:.2f} ms, between forwards {p['between_ms_per_forward']} ms a forward, masked tokens a"
          f" step {p['masked_tokens_per_step']}")
    print("  host ranges (count, ms): " + ", ".join(f"{k} {v['count']}x {v['ms']:.1f}" for k, v in list(r["host_ranges"].items())[:12]))


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    model = "tiny" if args.smoke else (args.model or "qwen05-smol")
    path = (str(cb.qwen05_smol(Path(args.checkpoint_dir) / model, small=model == "small-smol"))
            if model in cb.SMOL_MODELS else model)
    kwargs: dict[str, Any] = {"device": args.device}
    if args.device == "cuda":
        kwargs.update(dtype="bfloat16", max_running_requests=256)
    if args.optimistic != "default":
        kwargs["optimistic_grammar"] = args.optimistic == "on"
    if args.grammar_backend != "default":
        import os

        os.environ["OMNI_ASYNC_GRAMMAR_BACKEND"] = args.grammar_backend
    result: dict[str, Any] = {"tool": "constrained_gaps", "args": vars(args), "model": model,
                              "machine": cb.C.machine_facts(), "arms": {}}
    engine = await Engine.load(path, loop="overlap", **kwargs)
    replay = cb.GrammarReplay(engine.tokenizer, engine.scheduler.info().get("grammar_backend"))
    async with engine:
        work = cb.workload(args.requests, engine.tokenizer.vocab_size, args.smoke, 0)
        for arm in args.arms:
            await cb.run_arm(engine, work, arm, replay)  # warm-up
        for arm in args.arms:
            result["arms"][arm] = r = await profile_arm(args, engine, work, arm, replay)
            print_arm(arm, r)
            save_json(args.out, result)
    replay.close()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default=None, help="default qwen05-smol (the bench's CUDA model); tiny with --smoke")
    ap.add_argument("--arms", default="free,all")
    ap.add_argument("--requests", type=int, default=None, help="default 256 (8 with --smoke)")
    ap.add_argument("--optimistic", choices=("default", "off", "on"), default="default")
    ap.add_argument("--grammar-backend", choices=("default", "llguidance", "xgrammar"), default="default")
    ap.add_argument("--min-gap-us", type=float, default=5.0)
    ap.add_argument("--trace-dir", default=None)
    ap.add_argument("--checkpoint-dir", default="/tmp/omni-bench-checkpoints")
    ap.add_argument("--smoke", action="store_true", help="CPU, the bench's tiny model, 8 short requests")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.arms = [a for a in args.arms.split(",") if a]
    if args.smoke:
        args.device = "cpu"
    args.requests = args.requests or (8 if args.smoke else 256)
    args.out = args.out or ("constrained_gaps_smoke.json" if args.smoke else "constrained_gaps.json")
    result = asyncio.run(main_async(args))
    print(f"\nsaved {save_json(args.out, result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
