"""Where the host time of NV256 goes (issue: the host path). Run on the CUDA machine.

One warm run of nano-vllm's workload (``bench/nv256.py``'s, defaults, sampled), then the
same run under cProfile (Python 3.12's profiler sees every thread), then batch-1 decode
under cProfile and torch.profiler (CPU and CUDA activity). Writes, under ``--out-dir``:
``nv_cprofile.txt`` (top functions by own time and by cumulative time), ``b1_cprofile.txt``,
``b1_torch.txt`` (kernel and op table) and ``summary.json`` (tok/s with and without the
profiler, steps, calls per token).

    python tools/nv256_profile.py --out-dir $OUT/profile [--loop overlap] [--requests 256]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # _common and the benchmarks
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's omni_async

from nv256 import QWEN05, SMOKE_SHAPE, Workload, make_checkpoint, run_nv  # noqa: E402

from omni_async import Engine, SamplingParams  # noqa: E402
from omni_async.backends.native.builder import build_off_this_thread  # noqa: E402


DEV: dict = {}  # the engine's device and dtype
EXTRA: dict = {}  # --engine: more engine fields for the NV run


def stats_text(prof: cProfile.Profile, limit: int) -> tuple[str, int]:
    out = io.StringIO()
    st = pstats.Stats(prof, stream=out)
    calls = sum(v[1] for v in st.stats.values())  # primitive + recursive calls, every function
    st.sort_stats("tottime").print_stats(limit)
    st.sort_stats("cumulative").print_stats(limit)
    st.sort_stats("tottime").print_callers(25)
    return out.getvalue(), calls


class Timeline:
    """Per processed step: when its output reached the host, how long processing took,
    the batch's rows, mode and forwards per row (a probe: it wraps the stepper's sink)."""

    def __init__(self, eng: Engine) -> None:
        self.rows: list[tuple[float, float, int, str, int]] = []
        stepper = eng.scheduler.stepper
        inner = stepper.sink.on_step_output

        def timed(batch, out):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            inner(batch, out)
            steps = getattr(batch, "row_steps", None)
            self.rows.append((t0, time.perf_counter() - t0, batch.size, "d" if batch.is_decode else "p", max(steps) if steps else 1))

        stepper.sink.on_step_output = timed

    def summary(self) -> dict:
        """Steps grouped by (mode, k, batch size band): count, wall share between outputs, host processing."""
        groups: dict[str, list[float]] = {}
        for (t, took, size, mode, k), nxt in zip(self.rows, self.rows[1:]):
            band = "<16" if size < 16 else "<64" if size < 64 else "<256" if size < 256 else "256+"
            g = groups.setdefault(f"{mode} k={k} rows{band}", [0, 0.0, 0.0, 0])
            g[0] += 1
            g[1] += nxt[0] - t
            g[2] += took
            g[3] += size * k
        return {key: {"steps": g[0], "wall_s": round(g[1], 4), "process_s": round(g[2], 4), "row_forwards": g[3]}
                for key, g in sorted(groups.items())}


async def profile_nv(path: str, loop: str, wl: Workload, out: Path) -> dict:
    eng = Engine.from_pretrained(path, loop=loop, **DEV, **EXTRA)
    async with eng:
        await eng.generate(input_ids=wl.prompts[0][:32], sampling=SamplingParams(max_new_tokens=8))
        timeline = Timeline(eng)
        plain = await run_nv(eng, wl, 0.6)
        steps = timeline.summary()
        timeline.rows.clear()
        for key, g in steps.items():
            print(f"  {key:24s} {g}", flush=True)
        print(f"plain: {plain['tok_s']:.0f} tok/s gpu {plain['gpu_busy_mean']} cpu/wall {plain['cpu_over_wall']:.2f}", flush=True)
        prof = cProfile.Profile()
        prof.enable()
        profiled = await run_nv(eng, wl, 0.6)
        prof.disable()
        info = eng.scheduler.info()
    text, calls = stats_text(prof, 90)
    (out / "nv_cprofile.txt").write_text(text)
    print(f"profiled: {profiled['tok_s']:.0f} tok/s; {calls / profiled['tokens']:.1f} calls per token", flush=True)
    return {"plain": plain, "steps": steps, "profiled": profiled, "calls_per_token": calls / profiled["tokens"],
            "info": {k: v for k, v in info.items() if isinstance(v, (int, float, str))}}


async def profile_kernels(path: str, loop: str, wl: Workload, out: Path) -> dict:
    """NV256 under torch.profiler, sampled then greedy: the device's time by kernel."""
    eng = Engine.from_pretrained(path, loop=loop, **DEV, **EXTRA)
    res: dict = {}
    async with eng:
        await eng.generate(input_ids=wl.prompts[0][:32], sampling=SamplingParams(max_new_tokens=8))
        for temperature, name in ((0.6, "sampled"), (0.0, "greedy")):
            await run_nv(eng, wl, temperature)  # warm
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            with torch.profiler.profile(activities=acts) as tp:
                r = await run_nv(eng, wl, temperature)
            key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
            (out / f"kernels_{name}.txt").write_text(tp.key_averages().table(sort_by=key, row_limit=45, max_name_column_width=90))
            res[name] = {"tok_s_profiled": r["tok_s"], "wall_s": r["wall_s"]}
            print(f"kernels {name}: {r['tok_s']:.0f} tok/s under the profiler", flush=True)
    return res


async def profile_b1(path: str, loop: str, out: Path, new: int = 256) -> dict:
    prompt = list(range(100, 200))
    sp = SamplingParams(max_new_tokens=new, ignore_eos=True)
    eng = Engine.from_pretrained(path, loop=loop, **DEV)
    res: dict = {}
    async with eng:
        await eng.generate(input_ids=prompt, sampling=sp)
        for name in ("plain", "cprofile", "torch"):
            prof = cProfile.Profile() if name == "cprofile" else None
            tp = (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
                  if name == "torch" else None)
            if prof:
                prof.enable()
            if tp:
                tp.__enter__()
            t0 = time.perf_counter()
            r = await eng.generate(input_ids=prompt, sampling=sp)
            wall = time.perf_counter() - t0
            if tp:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                tp.__exit__(None, None, None)
                (out / "b1_torch.txt").write_text(
                    tp.key_averages().table(sort_by="self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total", row_limit=40) + "\n\n"
                    + tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
            if prof:
                prof.disable()
                text, calls = stats_text(prof, 60)
                (out / "b1_cprofile.txt").write_text(text)
                res["calls_per_token"] = calls / new
            res[f"{name}_ms_per_token"] = 1000 * wall / len(r.output_ids)
            print(f"b1 {name}: {res[f'{name}_ms_per_token']:.3f} ms/token", flush=True)
        res["info"] = {k: v for k, v in eng.scheduler.info().items() if isinstance(v, (int, float, str))}
    return res


async def main_async(args: argparse.Namespace) -> dict:
    shape, name = (SMOKE_SHAPE, "nv-qwen2-smoke") if args.smoke else (QWEN05, "nv-qwen2-05b-bf16")
    DEV.update(device="cpu", dtype="float32") if args.smoke else DEV.update(device="cuda", dtype="bfloat16")
    folder = Path(tempfile.gettempdir()) / name
    path = str(build_off_this_thread(lambda: make_checkpoint(folder, shape, getattr(torch, DEV["dtype"]), DEV["device"])))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = {"loop": args.loop, "requests": args.requests}
    if "nv" in args.sections:
        wl = Workload(8, 0, prompt_len=(10, 40), id_max=1000, new_tokens=(5, 24)) if args.smoke else Workload(args.requests, 0)
        result["nv"] = await profile_nv(path, args.loop, wl, out)
    if "kernels" in args.sections:
        wl = Workload(8, 0, prompt_len=(10, 40), id_max=1000, new_tokens=(5, 24)) if args.smoke else Workload(args.requests, 0)
        result["kernels"] = await profile_kernels(path, args.loop, wl, out)
    if "b1" in args.sections:
        result["b1"] = await profile_b1(path, args.loop, out)
    (out / "summary.json").write_text(json.dumps(result, indent=1, default=str))
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--loop", default="overlap")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--sections", default="nv,b1")
    ap.add_argument("--engine", default="{}", help="JSON: engine fields for the NV run (a tuned configuration)")
    ap.add_argument("--smoke", action="store_true", help="CPU, a tiny random Qwen2 (checks the script runs)")
    args = ap.parse_args()
    EXTRA.update(json.loads(args.engine))
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
