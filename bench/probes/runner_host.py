"""Host cost of the runner per decode step, without the stage: scheduling (batch core),
building inputs, sampling and collecting, in microseconds per row, at several batch
sizes; plus the sampler alone over a 32k vocabulary.

Run it under this checkout, or with ``--code DIR`` under another checkout of the
package (for a before/after comparison: both write JSON under bench/results/).
The script speaks both runner contracts (``launch``/``collect`` and the older
``launch_step``/``finish_step``).

    python bench/probes/runner_host.py --batches 64,256 --steps 30
    python bench/probes/runner_host.py --code /path/to/older/checkout --label before
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: _common and the benchmarks


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--code", default=str(Path(__file__).resolve().parents[2]), help="import omni_async from this checkout")
    ap.add_argument("--label", default="current")
    args = ap.parse_args()
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
