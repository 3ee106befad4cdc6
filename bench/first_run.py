"""First run against second: does a fresh process serve its first NV256 run as fast as
its second? (issue 60, "no compilation inside a request").

Each trial is a fresh Python process that builds the engine (``Engine.from_pretrained``,
defaults, bf16, Qwen2-0.5B shape with random weights, as ``bench/nv256.py``), then runs
NV256 twice on it, with no request of its own before the first run. Two trials per
repeat and checkout, in order:

- ``cold``: a fresh, empty kernel cache (``OMNI_ASYNC_KERNEL_CACHE`` and ``TRITON_HOME``
  point into a new temporary folder, ``TRITON_CACHE_DIR`` unset): a fresh machine;
- ``disk``: another fresh process over the cache ``cold`` left: what every later start
  of the server sees.

Per trial: the build's seconds, each run's output tok/s and time to first token (median
and slowest), the first run's tok/s over the second's, and the Triton kernels compiled
outside the start's warm-up (``omni_async.kernels.triton_cache.late_compiles``; ``-``
for a checkout without it). Goals: the first run within 5% of the second, its median
first token within 50 ms of the second's.

    python bench/first_run.py [--code /path/to/main --code . --labels main,branch]
        [--repeats 3] [--mode sampled|greedy] [--loop overlap] [--requests 256] [--out FILE]

``--smoke`` runs a tiny random Qwen2 on the CPU with a scaled-down workload (checks the
script; nothing is compiled there).

Where the first run loses its time (``bench/_first_run_probe.py``): every child also
records, for each run, the CUDA caching allocator's counters (segments allocated with
``cudaMalloc``, allocation retries, reserved bytes), the pinned host allocator's
(``cudaHostAlloc`` blocks), the stage's counters (``model_info``: steps, graphs captured
late) and its build's phases (load, KV, kernel warm-up, graph captures), and prints them
as one line per trial. ``--profile`` adds ``torch.profiler`` (CPU and CUDA activities)
over each run: host ops and CUDA runtime/driver calls summed by name, first run beside
second, what the first lost (printed for the first repeat; every trial in the JSON). A
profiled run is slower than a plain one (compare its first run with its second only).
``--env KEY=VALUE`` sets a variable in every child, ``--env LABEL:KEY=VALUE`` in that
label's; a checkout may be given twice under two labels, e.g. an arm with
``CUDA_MODULE_LOADING=EAGER`` (``FIRST_RUN_GC_COLLECT=1``: the child runs a full GC pass
after the build, outside its time):

    python bench/first_run.py --code . --code . --labels lazy,eager \
        --env eager:CUDA_MODULE_LOADING=EAGER --profile
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve()


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One fresh process: build, run, run again; the JSON line the parent reads."""
    t_start = time.perf_counter()
    import asyncio

    import omni_async  # the checkout on PYTHONPATH, before nv256 puts this one's on the path
    from omni_async import Engine, SamplingParams

    sys.path.insert(0, str(SCRIPT.parent))
    import _first_run_probe as probe
    from nv256 import Workload

    try:
        from omni_async.kernels.triton_cache import late_compiles
    except ImportError:  # a checkout from before the watch
        late_compiles = None
    phases = probe.Phases().install()
    gc_watch = probe.GcWatch()

    wl = Workload(args.requests or 8, 0, prompt_len=(10, 40), id_max=1000, new_tokens=(5, 24)) if args.smoke else Workload(args.requests or 256, 0)
    temperature = 0.6 if args.mode == "sampled" else 0.0

    async def one(eng: Engine, prompt: list[int], new: int, ttft: list[float]) -> int:
        sp = SamplingParams(max_new_tokens=new, temperature=temperature, ignore_eos=True)
        t0, n = time.perf_counter(), 0
        async for d in eng.stream(input_ids=prompt, sampling=sp):
            if not n and d.token_ids:
                ttft.append(time.perf_counter() - t0)
            n += len(d.token_ids)
        return n

    async def stage_counters(eng: Engine) -> dict[str, Any]:
        return (await eng.model_info()).get("data", {})

    async def timed(eng: Engine) -> dict[str, Any]:
        assert (await eng.flush_cache()).get("success")  # the second run sees no cached prefixes either
        ttft: list[float] = []
        late0 = len(late_compiles()) if late_compiles else 0
        info0 = await stage_counters(eng)
        probe.reset_peaks()
        dev0 = {**probe.device_counters(), **gc_watch.snapshot()}
        gc_watch.reset_longest()
        prof = probe.RunProfile() if args.profile else None
        if prof is not None:
            prof.__enter__()
        t0 = time.perf_counter()
        try:
            counts = await asyncio.gather(*(one(eng, p, m, ttft) for p, m in zip(wl.prompts, wl.max_tokens)))
            wall = time.perf_counter() - t0
        finally:
            if prof is not None:
                prof.__exit__(None, None, None)
        dev1 = {**probe.device_counters(), **gc_watch.snapshot(), "gc.gen2.longest_ms": gc_watch.longest_ms()}
        late = late_compiles()[late0:] if late_compiles else None
        out = {"tok_s": sum(counts) / wall, "wall_s": wall, "tokens": sum(counts), "ttft_median_s": statistics.median(ttft),
               "ttft_max_s": max(ttft), "late_compiles": None if late is None else len(late), "late_kernels": late,
               "device_counters": probe.delta(dev0, dev1), "stage_counters": probe.delta(info0, await stage_counters(eng))}
        if prof is not None:
            out["profile"] = prof.summary()
            out["profile_parse_s"] = prof.seconds_to_parse
        return out

    async def main() -> dict[str, Any]:
        t0 = time.perf_counter()
        device = {"device": "cpu", "dtype": "float32"} if args.smoke else {"device": "cuda", "dtype": "bfloat16"}
        eng = Engine.from_pretrained(args.path, loop=args.loop, **device)
        build = time.perf_counter() - t0
        collect_s = None
        if os.environ.get("FIRST_RUN_GC_COLLECT") == "1":  # an arm: a full GC pass after the build, outside it
            import gc

            t1 = time.perf_counter()
            gc.collect()
            collect_s = time.perf_counter() - t1
        built = {**probe.device_counters(), **gc_watch.snapshot()}
        if args.profile:  # the profiler's own start-up (CUPTI's) outside the first run
            with probe.RunProfile():
                pass
        async with eng:
            first = await timed(eng)
            second = await timed(eng)
        return {"process_to_engine_s": t0 - t_start + build, "build_s": build, "first": first, "second": second,
                "omni_async": str(Path(omni_async.__file__).parent), "build_phases": phases.times,
                "after_build": {k: built[k] for k in ("reserved_bytes.all.current", "segment.all.allocated", "host.num_host_alloc",
                                                      "gc.gen2.passes", "gc.gen2.ms") if k in built},
                "env": {k: os.environ[k] for k in sorted(args.env_keys) if k in os.environ}, "gc_collect_after_build_s": collect_s}

    return asyncio.run(main())


def run_trial(code: str, args: argparse.Namespace, cache: Path, path: Path, extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"}
    env.update(PYTHONPATH=str(Path(code).resolve()), OMNI_ASYNC_KERNEL_CACHE=str(cache / "omni"), TRITON_HOME=str(cache / "home"))
    env.update(extra_env or {})
    cmd = [sys.executable, str(SCRIPT), "--child", "--path", str(path), "--loop", args.loop, "--mode", args.mode,
           "--requests", str(args.requests or 0)] + (["--smoke"] if args.smoke else []) + (["--profile"] if args.profile else [])
    cmd += [f"--env-key={k}" for k in sorted(extra_env or {})]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(Path(code).resolve()))
    if out.returncode:
        raise SystemExit(f"child failed ({code}):\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary_line(label: str, trial: str, r: dict[str, Any]) -> str:
    f, s = r["first"], r["second"]
    late = "-" if f["late_compiles"] is None else f"{f['late_compiles']}/{s['late_compiles']}"
    return (f"{label:>10} {trial:>5}  build {r['build_s']:6.1f} s  first {f['tok_s']:9.0f} tok/s ttft {1000 * f['ttft_median_s']:7.0f} ms"
            f" (max {1000 * f['ttft_max_s']:6.0f})  second {s['tok_s']:9.0f} tok/s ttft {1000 * s['ttft_median_s']:7.0f} ms"
            f"  first/second {f['tok_s'] / s['tok_s']:.3f}  ttft +{1000 * (f['ttft_median_s'] - s['ttft_median_s']):.0f} ms"
            f"  late compiles {late}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--path", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--code", action="append", help="a checkout to measure (repeat for several; default: this one)")
    ap.add_argument("--labels", default="")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mode", default="sampled", choices=("sampled", "greedy"))
    ap.add_argument("--loop", default="overlap")
    ap.add_argument("--requests", type=int, default=None, help="NV256's requests (default 256; 8 with --smoke)")
    ap.add_argument("--smoke", action="store_true", help="CPU, a tiny random Qwen2, a scaled-down workload")
    ap.add_argument("--out", default=None, help="JSON results (default bench/results/first_run[_smoke].json)")
    ap.add_argument("--profile", action="store_true", help="torch.profiler over each run (CPU and CUDA activities), first beside second")
    ap.add_argument("--profile-top", type=int, default=25, help="rows of the profile table (by the first run's self time)")
    ap.add_argument("--env", action="append", metavar="[LABEL:]KEY=VALUE", help="an environment variable for every child, or a label's")
    ap.add_argument("--env-key", dest="env_keys", action="append", default=[], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return 0

    sys.path.insert(0, str(SCRIPT.parent))
    import torch
    from _common import machine_facts, save_json
    from nv256 import QWEN05, SMOKE_SHAPE, make_checkpoint

    from omni_async.backends.native.builder import build_off_this_thread

    import _first_run_probe as probe

    codes = args.code or [str(SCRIPT.parents[1])]
    labels = args.labels.split(",") if args.labels else [Path(c).resolve().name for c in codes]
    if len(labels) != len(codes) or len(set(labels)) != len(labels):
        raise SystemExit(f"--labels: one distinct label per --code ({len(codes)} codes, labels {labels})")
    envs = probe.parse_env(args.env, labels)
    shape, device, dtype = (SMOKE_SHAPE, "cpu", torch.float32) if args.smoke else (QWEN05, "cuda", torch.bfloat16)
    folder = Path(tempfile.gettempdir()) / ("nv-qwen2-smoke" if args.smoke else "nv-qwen2-05b-bf16")
    path = build_off_this_thread(lambda: make_checkpoint(folder, shape, dtype, device))
    trials: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        for code, label in zip(codes, labels):
            cache = Path(tempfile.mkdtemp(prefix="first-run-cache-"))
            try:
                for trial in ("cold", "disk"):
                    r = run_trial(code, args, cache, path, envs[label])
                    r.update(label=label, trial=trial, repeat=rep)
                    trials.append(r)
                    print(summary_line(label, trial, r), flush=True)
                    print(probe.counters_line(r["first"]["device_counters"], r["second"]["device_counters"],
                                              r["first"]["stage_counters"], r["second"]["stage_counters"]))
                    print(probe.phases_line(r["build_phases"]), flush=True)
            finally:
                shutil.rmtree(cache, ignore_errors=True)
    print("\nmedians over the repeats:")
    for label in labels:
        for trial in ("cold", "disk"):
            rs = [r for r in trials if r["label"] == label and r["trial"] == trial]
            ratio = statistics.median(r["first"]["tok_s"] / r["second"]["tok_s"] for r in rs)
            gap = statistics.median(r["first"]["ttft_median_s"] - r["second"]["ttft_median_s"] for r in rs)
            build = statistics.median(r["build_s"] for r in rs)
            print(f"{label:>10} {trial:>5}: first/second tok/s {ratio:.3f}, first-token gap {1000 * gap:+.0f} ms, build {build:.1f} s")
    if args.profile:
        for r in trials:
            if r["repeat"] == 0:
                f, s = r["first"], r["second"]
                r["profile_compare"] = probe.compare(f["profile"], s["profile"], args.profile_top)
                g1, g2 = probe.gpu_totals(f["profile"]), probe.gpu_totals(s["profile"])
                print(f"\nprofile, {r['label']} {r['trial']} (repeat 0; first {f['tok_s']:.0f} / second {s['tok_s']:.0f} tok/s"
                      f" under the profiler; device time {g1['gpu_ms']:.0f} / {g2['gpu_ms']:.0f} ms over"
                      f" {g1['gpu_events']} / {g2['gpu_events']} kernels and copies):")
                print("\n".join(probe.table(r["profile_compare"])))
    out = args.out or str(SCRIPT.parent / "results" / ("first_run_smoke.json" if args.smoke else "first_run.json"))
    save_json(out, {"bench": "first_run", "args": {k: v for k, v in vars(args).items() if k not in ("child", "path")},
                    "env": envs,
                    "machine": machine_facts(), "trials": trials})
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
