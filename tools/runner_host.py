"""Host cost of the runner per decode step, without the stage: scheduling (batch core),
building inputs, sampling and collecting, in microseconds per row, at several batch
sizes; plus the sampler alone over a 32k vocabulary.

Run it under this checkout, or with ``--code DIR`` under another checkout of the
package (for a before/after comparison: both write JSON under bench/results/).
The script speaks both runner contracts (``launch``/``collect`` and the older
``launch_step``/``finish_step``).

    python tools/runner_host.py --batches 64,256 --steps 30
    python tools/runner_host.py --code /path/to/older/checkout --label before

``--launch`` measures the decode launch and collect alone as the CUDA path runs them
(issue 42): k forwards a step through the fused launch's host path (``assign``,
``plan_fused``, the ``[B, 5]`` inputs, ``publish_steps``, the host copy) with the
replay replaced by a null one (as ``tools/host_overhead.py --fused`` does), thread CPU
time per row, for a steady batch (every row decodes every step) and one with churn
(rows finish and others join between decode steps). With ``--code`` given more than once
each checkout runs in its own process, interleaved per repeat (before/after):

    python tools/runner_host.py --launch --batches 64,256 --k 8 --code /work/main --code . --labels main,branch

With ``--device cuda`` the launch is the real one on the GPU (the tiny model, its fused
graphs replayed) and the figures are the host's CPU time around it.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # _common and the benchmarks


def _timed(fn, *args, **kw):
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    return out, time.perf_counter() - t0


def _sampling_params(kind: str, i: int, max_new: int):
    from omni_async import SamplingParams

    if kind == "greedy":
        return SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    # mixed: half greedy, half seeded top-p with a repetition penalty on every fourth
    if i % 2 == 0:
        return SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    return SamplingParams(
        max_new_tokens=max_new, ignore_eos=True, temperature=0.8, top_p=0.9, seed=i,
        repetition_penalty=1.2 if i % 4 == 1 else 1.0,
    )


def step_costs(bs: int, steps: int, kind: str) -> dict:
    """Decode steps of ``bs`` rows on the tiny model (CPU): medians in us per row."""
    import torch

    from omni_async.backends.native.builder import build_native_stack
    from omni_async.config import SchedulerConfig
    from omni_async.core.request import Request, RequestData
    from omni_async.core.runner_io import SchedulerOutput, SchedulerRequest

    prompt = 128
    config = SchedulerConfig(
        max_running_requests=bs, kv_capacity_tokens=bs * (prompt + steps + 32), max_prefill_tokens=1 << 20,
        chunked_prefill_size=0,
    )
    stack = build_native_stack("tiny", config, device="cpu")
    core, runner = stack.core, stack.runner
    new_api = hasattr(runner, "collect")
    for i in range(bs):
        req = Request(rid=f"b{i}", prompt_ids=[2 + i % 200] * prompt, sampling=_sampling_params(kind, i, steps + 8))
        req.data = RequestData(req=req)
        core.add_request(req)
    costs: dict[str, list[float]] = {"schedule": [], "build": [], "sample": [], "collect": []}
    with torch.inference_mode():
        while True:
            batch, t_sched = _timed(core.get_next_batch)
            if batch is None:
                break
            so = SchedulerOutput([SchedulerRequest(r.rid, r.data) for r in batch.reqs], batch)
            measured = batch.is_decode and batch.size == bs
            if measured:
                fb, t_build = _timed(runner.build_forward_batch, so)
                logits = runner.forward(fb).logits
                t_sample = _sample_cost(runner, fb, batch, so, logits, new_api)
            pending = runner.launch(so) if new_api else runner.launch_step(so)
            out, t_collect = _timed(runner.collect if new_api else runner.finish_step, pending)
            core.process_result(batch, out.token_ids, out.logprobs)
            if measured:
                for key, t in (("schedule", t_sched), ("build", t_build), ("sample", t_sample), ("collect", t_collect)):
                    costs[key].append(t * 1e6 / bs)
    return {k: round(statistics.median(v[3:]), 3) for k, v in costs.items() if len(v) > 3}


def _sample_cost(runner, fb, batch, so, logits, new_api: bool) -> float:
    if new_api:
        from omni_async.runners.sampling import sample

        t0 = time.perf_counter()
        sb = runner.sampling_batch(fb, batch, so.requests, logits.shape[-1])
        sample(logits, sb)
        return time.perf_counter() - t0
    _, t = _timed(runner._sample_next_token_ids, logits.clone(), fb, batch, so.requests)
    return t


def sampler_costs(bs: int, vocab: int, kind: str, reps: int = 5) -> float:
    """The sampler alone on ``[bs, vocab]`` random logits from plain rows: us per row."""
    import torch

    from omni_async.runners.sampling import RowSampling, sample_rows

    rng = random.Random(bs)
    rows = [
        RowSampling(_sampling_params(kind, i, 64), f"s{i}", 5, [rng.randrange(vocab) for _ in range(20)], [])
        for i in range(bs)
    ]
    logits = torch.randn(bs, vocab)
    times = []
    for _ in range(reps):
        x = logits.clone()
        _, t = _timed(sample_rows, x, rows, False)
        times.append(t)
    return round(statistics.median(times) * 1e6 / bs, 3)


def _null_runner(runner) -> None:
    """The runner's device work replaced by what the CUDA path costs the host around it:
    prefill without a forward, a fused decode's replay as the host calls around a graph
    replay (``tools/host_overhead.py``'s null device) and one op for its tokens."""
    import torch

    from host_overhead import StaticInputs, replay_host_calls, route_fused_launches
    from omni_async.runners.types import BatchResult

    vocab = runner.model.config.vocab_size
    ok = torch.ones(4096, dtype=torch.bool)

    def fake(ids, pos):
        return (ids * 7 + pos * 13 + 1) % (vocab - 3) + 3

    class NullRunner(type(runner)):  # type: ignore[misc]
        def forward(self, fb):
            rows = fb.ctx.logits_rows
            tokens = fake(fb.input_ids.index_select(0, rows), fb.positions.index_select(0, rows))
            return BatchResult(logits=torch.zeros((tokens.shape[0], 1)), graph_greedy=(tokens, ok[: tokens.shape[0]]))

    fused = runner.fused_decode
    static = StaticInputs(4096)
    later = torch.arange(64)[:, None]

    def null_run(fb, slots, eager_ctx):
        # What a replay costs the host (host_overhead.replay_host_calls: the inputs into a
        # static buffer, the rows' tables, newest tokens and settings gathered), and the
        # k forwards' tokens as one op (the next ids in turn).
        fused.launches += 1
        inputs, token = replay_host_calls(static, fb, slots)
        out = torch.ones((2, fb.steps, inputs.shape[0]), dtype=torch.long)
        torch.remainder(token + later[1 : fb.steps + 1], vocab, out=out[0])
        fb.inputs_dev = inputs
        return out, None

    runner.__class__ = NullRunner
    fused.run = null_run
    route_fused_launches(runner)


def launch_costs(bs: int, k: int, steps: int, churn: bool, device: str = "cpu") -> dict:
    """Thread CPU ns per row of a decode step's launch (and its parts) and collect, over
    ``steps`` decode steps of about ``bs`` rows, k forwards each: on the null device on
    CPU; on CUDA the tiny model's real fused launch (its graphs replayed), the wait for
    the step's completion left out of both figures."""
    import torch

    from omni_async.backends.native.builder import build_native_stack
    from omni_async.config import SamplingParams, SchedulerConfig
    from omni_async.core.request import Request, RequestData
    from omni_async.core.runner_io import SchedulerOutput
    from omni_async.stage.stepper import scheduler_requests

    new = steps * k + 16
    n_req = 2 * bs if churn else bs
    config = SchedulerConfig(max_running_requests=bs, kv_capacity_tokens=n_req * (512 + new + 64), max_prefill_tokens=1 << 16,
                             chunked_prefill_size=1 << 16, decode_steps=k)
    stack = build_native_stack("tiny", config, device=device)
    core, runner = stack.core, stack.runner
    if device == "cpu":
        _null_runner(runner)
    for i in range(n_req):
        # churn: new tokens spread so that rows finish through the run and waiting ones join
        max_new = (k * (1 + i * steps // bs) + 3) if churn else new
        req = Request(rid=f"r{i}", prompt_ids=[3 + i % 97] * (64 + (i * 37) % 400),
                      sampling=SamplingParams(max_new_tokens=max_new, ignore_eos=True))
        req.data = RequestData(req=req)
        core.add_request(req)
    parts = {"assign": 0.0, "build_forward_batch": 0.0, "fused_step": 0.0}

    def timed(obj, name, key):
        inner = getattr(obj, name)

        def wrapper(*a, **kw):
            t0 = time.thread_time()
            try:
                return inner(*a, **kw)
            finally:
                parts[key] += time.thread_time() - t0

        setattr(obj, name, wrapper)

    timed(runner.inputs, "assign", "assign")
    timed(runner, "build_forward_batch", "build_forward_batch")
    # The launch and collect split finer (each part once per step, where it exists in the checkout).
    import omni_async.runners.base as base_mod

    fine = [(runner, "_fused_batch", "plan_and_host_array"), (runner.fused_decode, "batch", "host_array"),
            (runner.fused_decode, "run", "replay"), (runner.inputs, "publish_steps", "publish"),
            (base_mod, "copy_to_host", "copy_to_host"), (runner, "record_completion", "record_completion"),
            (base_mod, "host_values", "host_values"), (base_mod, "live_rows", "live_rows"), (runner, "_advance", "advance")]
    module_attrs = {name: getattr(base_mod, name) for obj, name, _ in fine if obj is base_mod}  # put back after the run
    for obj, name, key in fine:
        if obj is not None and hasattr(obj, name):
            parts[key] = 0.0
            timed(obj, name, key)
    launch = collect = 0.0
    rows = decode_steps = 0
    warm = 3  # decode steps not counted (first calls)
    with torch.inference_mode():
        while decode_steps < steps:
            batch = core.get_next_batch()
            if batch is None:
                break
            so = SchedulerOutput(scheduler_requests(batch.reqs), batch)
            kept = dict(parts)
            measured = batch.is_decode and (churn or batch.size == bs)
            if measured and warm:
                warm, measured = warm - 1, False
            t0 = time.thread_time()
            pending = runner.launch(so)
            t1 = time.thread_time()
            if pending.event is not None:  # CUDA: the device's time is not the host's
                pending.event.synchronize()
            t2 = time.thread_time()
            out = runner.collect(pending)
            t3 = time.thread_time()
            core.process_result(batch, out.token_ids, out.logprobs)
            if measured:
                launch += t1 - t0
                collect += t3 - t2
                rows += batch.size
                decode_steps += 1
            else:
                parts.update(kept)
    for name, fn in module_attrs.items():
        setattr(base_mod, name, fn)
    if not rows:
        return {}
    ns = 1e9 / rows
    res = {"launch_ns_per_row": launch * ns, "collect_ns_per_row": collect * ns, "rows_per_step": rows / decode_steps,
           "assign_ns_per_row": parts["assign"] * ns, "build_ns_per_row": parts["build_forward_batch"] * ns}
    res["launch_us_per_step"] = launch * 1e6 / decode_steps
    for key, t in parts.items():  # every part in us per step (copy_to_host also counts prefill steps' copies: none here)
        res[f"{key}_us_per_step"] = t * 1e6 / decode_steps
    res["collect_us_per_step"] = collect * 1e6 / decode_steps
    return {key: round(v, 1) for key, v in res.items()}


def launch_main(args) -> int:
    """``--launch``: each checkout in its own process, interleaved per repeat."""
    import json
    import subprocess

    here = Path(__file__).resolve()
    from _common import machine_facts, save_json

    codes = args.code_list or [str(here.parents[1])]
    labels = args.labels.split(",") if args.labels else [Path(c).resolve().name for c in codes]
    runs: dict[str, list[dict]] = {label: [] for label in labels}
    for rep in range(args.repeats):
        for code, label in zip(codes, labels):
            env = {**__import__("os").environ, "PYTHONPATH": str(Path(code).resolve())}
            cmd = [sys.executable, str(here), "--launch-child", "--batches", args.batches, "--k", str(args.k),
                   "--steps", str(args.steps), "--threads", str(args.threads), "--device", args.device]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, cwd=str(Path(code).resolve()))
            r = json.loads(out.stdout.strip().splitlines()[-1])
            runs[label].append(r)
            print(f"rep {rep} {label:>10}: " + "  ".join(
                f"{case} launch {c['launch_ns_per_row']:.0f} collect {c['collect_ns_per_row']:.0f}" for case, c in r.items()), flush=True)
    summary: dict = {}
    print(f"\n{'label':>10} {'case':>14} {'figure':>20} {'median':>9} {'min':>9} {'max':>9}   (thread CPU ns per row, k={args.k})")
    for label in labels:
        for case in runs[label][0]:
            for fig in runs[label][0][case]:
                xs = [r[case][fig] for r in runs[label]]
                s = {"median": round(statistics.median(xs), 1), "min": min(xs), "max": max(xs)}
                summary[f"{label}/{case}/{fig}"] = s
                print(f"{label:>10} {case:>14} {fig:>20} {s['median']:>9.1f} {s['min']:>9.1f} {s['max']:>9.1f}")
    if len(labels) == 2:
        a, b = labels
        for case in runs[a][0]:
            for fig in ("launch_ns_per_row", "collect_ns_per_row", "assign_ns_per_row", "build_ns_per_row"):
                ratios = [rb[case][fig] / ra[case][fig] for ra, rb in zip(runs[a], runs[b]) if ra[case].get(fig)]
                if ratios:
                    s = {"median": round(statistics.median(ratios), 3), "min": round(min(ratios), 3), "max": round(max(ratios), 3)}
                    summary[f"{b}/{a}/{case}/{fig}"] = s
                    print(f"paired {b}/{a} {case:>14} {fig:>20}: {s['median']:.3f} [{s['min']:.3f}-{s['max']:.3f}]")
    path = save_json(args.out, {"config": vars(args), "labels": labels, "runs": runs, "summary": summary, "machine": machine_facts()})
    print(f"saved {path}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--launch", action="store_true", help="the fused decode launch and collect on the null device")
    ap.add_argument("--launch-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--k", type=int, default=8, help="with --launch: forwards per decode step")
    ap.add_argument("--device", default="cpu", help="with --launch: cpu (the null device) or cuda (the real fused launch)")
    ap.add_argument("--repeats", type=int, default=5, help="with --launch: runs per checkout")
    ap.add_argument("--labels", default="", help="with --launch: labels of the --code checkouts")
    ap.add_argument("--smoke", action="store_true", help="with --launch: a few steps of 16 rows, one repeat")
    ap.add_argument("--out", default="runner_host_launch.json")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--code", action="append", dest="code_list", help="import omni_async from this checkout (repeatable with --launch)")
    ap.add_argument("--label", default="current")
    args = ap.parse_args()
    if args.smoke:
        args.batches, args.steps, args.repeats = "16", 4, 1
    if args.launch_child:
        import json

        import torch

        torch.set_num_threads(args.threads)
        res = {}
        for bs in (int(b) for b in args.batches.split(",")):
            res[f"steady_b{bs}"] = launch_costs(bs, args.k, args.steps, churn=False, device=args.device)
            res[f"churn_b{bs}"] = launch_costs(bs, args.k, args.steps, churn=True, device=args.device)
        print(json.dumps(res))
        return 0
    if args.launch:
        return launch_main(args)
    args.code = (args.code_list or [str(Path(__file__).resolve().parents[1])])[0]
    sys.path.insert(0, str(Path(args.code).resolve()))
    import torch

    torch.set_num_threads(args.threads)
    import omni_async
    from _common import machine_facts, save_json

    batches = [int(b) for b in args.batches.split(",")]
    result = {"label": args.label, "package": str(Path(omni_async.__file__).parent), "steps": {}, "sampler": {}}
    print(f"{'kind':7} {'batch':>5} {'schedule':>9} {'build':>8} {'sample':>8} {'collect':>8}   us/row/step ({args.label})")
    for kind in ("greedy", "mixed"):
        for bs in batches:
            c = step_costs(bs, args.steps, kind)
            result["steps"][f"{kind}_b{bs}"] = c
            print(f"{kind:7} {bs:5d} {c['schedule']:9.2f} {c['build']:8.2f} {c['sample']:8.2f} {c['collect']:8.2f}")
    for kind in ("greedy", "mixed"):
        for bs in batches:
            us = sampler_costs(bs, args.vocab, kind)
            result["sampler"][f"{kind}_b{bs}_v{args.vocab}"] = us
            print(f"sampler {kind:7} batch {bs:4d} vocab {args.vocab}: {us:.2f} us/row")
    result["machine"] = machine_facts()
    path = save_json(f"runner_host_{args.label}.json", result)
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
